"""EDM preconditioning identities, sampler correctness on Gaussian data, rectified flow."""
import math

import pytest
import torch
import torch.nn as nn

from tread.diffusion import EDM, EDMPrecond, RectifiedFlow, StackedRandomGenerator
from tread.sampling import classifier_free_guidance


class Recorder(nn.Module):
    """Backbone that records its inputs and returns a fixed output F."""

    def __init__(self, out):
        super().__init__()
        self.out = out

    def forward(self, x, noise_level, labels):
        self.seen = (x, noise_level, labels)
        return self.out


def test_edm_preconditioning_identities():
    sd = 0.5
    sigma = torch.tensor([0.002, 0.1, 0.5, 1.0, 80.0])
    F = torch.randn(5, 3, 4, 4)
    x = torch.randn(5, 3, 4, 4)
    backbone = Recorder(F)
    net = EDMPrecond(backbone, sigma_data=sd)
    D = net(x, sigma, torch.zeros(5, dtype=torch.long))
    s = sigma.reshape(-1, 1, 1, 1)
    c_skip, c_out, c_in = sd ** 2 / (s ** 2 + sd ** 2), s * sd / (s ** 2 + sd ** 2).sqrt(), 1 / (sd ** 2 + s ** 2).sqrt()
    torch.testing.assert_close(D, c_skip * x + c_out * F)
    torch.testing.assert_close(backbone.seen[0], c_in * x)
    torch.testing.assert_close(backbone.seen[1], sigma.log() / 4)
    # Unit-variance network input (EDM eq. 7): c_in^2 (sd^2 + s^2) = 1.
    torch.testing.assert_close(c_in ** 2 * (sd ** 2 + s ** 2), torch.ones_like(s))
    # Effective target (x - c_skip (x + n)) / c_out has unit variance: (1-c_skip)^2 sd^2 + c_skip^2 s^2 = c_out^2.
    torch.testing.assert_close((1 - c_skip) ** 2 * sd ** 2 + c_skip ** 2 * s ** 2, c_out ** 2)
    # Loss weight lambda = 1 / c_out^2.
    edm = EDM(sigma_data=sd)
    torch.testing.assert_close((s ** 2 + sd ** 2) / (s * sd) ** 2, 1 / c_out ** 2)
    assert edm.sigma_data == sd


class AuxBackbone(Recorder):
    """A backbone with an auxiliary output: (F, aux) when asked (return_aux=True), else F."""

    def forward(self, x, noise_level, labels, return_aux=False):
        self.aux = {"tokens": torch.randn(2)}
        return (self.out, self.aux) if return_aux else self.out


@pytest.mark.parametrize("objective", [EDM(), RectifiedFlow()])
def test_preconditioning_and_loss_pass_the_auxiliary_output_through(objective):
    """return_aux reaches the backbone; the algebra applies to its tensor only and aux comes back untouched, at the
    preconditioner and at the loss; without it the backbone is called as before (no return_aux keyword)."""
    x, sigma, labels = torch.randn(3, 3, 4, 4), torch.tensor([0.1, 1.0, 5.0]), torch.zeros(3, dtype=torch.long)
    backbone = AuxBackbone(torch.randn(3, 3, 4, 4))
    net = objective.precondition(backbone)
    out, aux = net(x, sigma / 10, labels, return_aux=True)
    assert aux is backbone.aux and torch.equal(out, net(x, sigma / 10, labels))
    torch.manual_seed(0)
    loss, aux = objective.loss(net, x, labels, return_aux=True)
    torch.manual_seed(0)
    assert aux is backbone.aux and torch.equal(loss, objective.loss(net, x, labels))
    assert isinstance(objective.precondition(Recorder(backbone.out))(x, sigma / 10, labels), torch.Tensor)


def test_karras_schedule_endpoints():
    t = EDM(num_steps=18).sigma_steps()
    assert len(t) == 19 and t[-1] == 0
    assert t[0].item() == pytest.approx(80.0) and t[-2].item() == pytest.approx(0.002)
    assert torch.all(t[:-1] > t[1:])


def test_edm_loss_is_unreduced_and_zero_for_perfect_denoiser():
    edm = EDM()
    x = torch.randn(6, 3, 4, 4)
    assert edm.loss(lambda xn, s, y: x, x, torch.zeros(6, dtype=torch.long)).abs().max() == 0
    assert edm.loss(lambda xn, s, y: xn * 0, x, torch.zeros(6, dtype=torch.long)).shape == x.shape


def gaussian_problem(D=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    mu = torch.randn(D, generator=g, dtype=torch.float64) * 0.5
    A = torch.randn(D, D, generator=g, dtype=torch.float64) * 0.4
    S = A @ A.T + 0.05 * torch.eye(D, dtype=torch.float64)
    return mu, S


def exact_denoiser(mu, S):
    """E[x | x + sigma n] for x ~ N(mu, S): mu + S (S + sigma^2 I)^-1 (y - mu)."""
    D = len(mu)

    def net(x, sigma, labels):
        y = x.reshape(x.shape[0], D).double()
        s2 = sigma.double().reshape(-1, 1, 1) ** 2
        M = S @ torch.linalg.inv(S + s2 * torch.eye(D, dtype=torch.float64))
        return (mu + torch.einsum("bij,bj->bi", M, y - mu)).reshape(x.shape).float()

    return net


@pytest.mark.parametrize("num_steps,S_churn", [(32, 0.0), (64, 10.0)])
def test_heun_sampler_reproduces_gaussian_moments(num_steps, S_churn):
    mu, S = gaussian_problem()
    edm = EDM(num_steps=num_steps, S_churn=S_churn)
    n = 6000
    gen = StackedRandomGenerator("cpu", range(n))
    noise = gen.randn([n, 3, 1, 1])
    x = edm.sample(exact_denoiser(mu, S), noise, torch.zeros(n, dtype=torch.long),
                   randn_like=gen.randn_like).reshape(n, 3).double()
    assert torch.allclose(x.mean(0), mu, atol=0.04)
    assert torch.allclose(torch.cov(x.T), S, atol=0.04)


def test_rf_euler_sampler_reproduces_gaussian_moments():
    mu, S = gaussian_problem(seed=1)
    den = exact_denoiser(mu, S)

    def velocity(z, t, labels):
        # z = (1-t) x + t n. With sigma = t/(1-t), y = z/(1-t) is x + sigma n, so
        # E[x|z] = den(y, sigma) and v = E[n - x | z] = (z - E[x|z]) / t.
        t4 = t.reshape(-1, 1, 1, 1).double()
        sigma = (t4 / (1 - t4)).clamp(max=1e4)
        x_hat = den((z / (1 - t4).clamp(min=1e-4)).float(), sigma.flatten().float(), labels).double()
        return ((z.double() - x_hat) / t4).float()

    rf = RectifiedFlow(num_steps=200)
    n = 6000
    noise = StackedRandomGenerator("cpu", range(n)).randn([n, 3, 1, 1])
    x = rf.sample(velocity, noise, torch.zeros(n, dtype=torch.long)).reshape(n, 3).double()
    assert torch.allclose(x.mean(0), mu, atol=0.05)
    assert torch.allclose(torch.cov(x.T), S, atol=0.05)


def test_rf_loss_zero_for_true_velocity():
    rf = RectifiedFlow()
    x = torch.randn(4, 3, 2, 2)
    torch.manual_seed(0)
    loss = rf.loss(lambda z, t, y: torch.zeros_like(z), x, torch.zeros(4, dtype=torch.long))
    assert loss.shape == x.shape and loss.sum() > 0


def test_classifier_free_guidance_combines_branches():
    def net(x, s, labels):
        return torch.where((labels == 9).reshape(-1, 1), torch.zeros_like(x), torch.ones_like(x))

    guided = classifier_free_guidance(net, 3.0, null_label=9)
    out = guided(torch.zeros(2, 5), torch.ones(2), torch.tensor([1, 2]))
    torch.testing.assert_close(out, torch.full((2, 5), 3.0))   # 0 + 3 * (1 - 0)
    assert classifier_free_guidance(net, 1.0, 9) is net


def test_stacked_generator_independent_of_batching():
    a = StackedRandomGenerator("cpu", [0, 1, 2, 3]).randn([4, 2, 3])
    b = torch.cat([StackedRandomGenerator("cpu", [0, 1]).randn([2, 2, 3]),
                   StackedRandomGenerator("cpu", [2, 3]).randn([2, 2, 3])])
    assert torch.equal(a, b)

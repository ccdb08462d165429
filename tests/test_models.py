"""DiT backbone: paper parameter counts, registry, shapes, adaLN-Zero init."""
import pytest
import torch

from tread.models import DIT_ARCHS, build_dit


@pytest.mark.parametrize("arch,expected_m", [("DiT-S/2", 33.0), ("DiT-B/2", 130.0), ("DiT-L/2", 458.0), ("DiT-XL/2", 675.0)])
def test_parameter_counts_match_paper(arch, expected_m):
    with torch.device("meta"):
        model = build_dit(arch, input_size=32, in_channels=4, num_classes=1000)
    count = sum(p.numel() for p in model.parameters()) / 1e6
    assert count == pytest.approx(expected_m, rel=0.01)


def test_registry_covers_sizes_and_patches():
    for size in ("T", "S", "B", "L", "XL"):
        for p in (2, 4, 8):
            assert f"DiT-{size}/{p}" in DIT_ARCHS
    with pytest.raises(ValueError, match="model.arch='DiT-M/2' is not a known DiT"):
        build_dit("DiT-M/2", 32, 4, 1000)
    with pytest.raises(ValueError, match="input_size=30 must be divisible by patch_size=4"):
        build_dit("DiT-T/4", 30, 4, 1000)


def test_forward_shapes_and_zero_init_output():
    model = build_dit("DiT-T/4", 32, 3, 10)
    x = torch.randn(2, 3, 32, 32)
    out = model(x, torch.rand(2), torch.tensor([0, 10]))          # 10 = the null class
    assert out.shape == x.shape and model.num_tokens == 64
    assert torch.count_nonzero(out) == 0                           # adaLN-Zero final layer


def test_state_dict_round_trip_has_no_position_buffer():
    a = build_dit("DiT-T/4", 32, 3, 10)
    assert "pos_embed" not in a.state_dict()
    b = build_dit("DiT-T/4", 32, 3, 10)
    b.load_state_dict(a.state_dict())
    for (na, pa), (nb, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert na == nb and torch.equal(pa, pb)


def _timm_layers(monkeypatch):
    """Build DiT from timm's layers, as DiT and the paper code do (timm stays a dependency for the paper code)."""
    from timm.layers import Mlp, PatchEmbed
    from timm.models.vision_transformer import Attention

    import tread.models.dit as dit
    monkeypatch.setattr(dit, "Attention", lambda dim, heads: Attention(dim, num_heads=heads, qkv_bias=True))
    monkeypatch.setattr(dit, "Mlp", lambda dim, hidden: Mlp(dim, hidden,
                                                            act_layer=lambda: torch.nn.GELU(approximate="tanh")))
    monkeypatch.setattr(dit, "PatchEmbed", lambda size, p, c, d: PatchEmbed(size, p, c, d, bias=True,
                                                                             strict_img_size=False))


@pytest.mark.parametrize("routed", [False, True])
def test_our_layers_equal_timms_weights_outputs_and_gradients(routed, monkeypatch):
    """Our PatchEmbed / Attention / Mlp against timm's inside a whole DiT: the same seed gives the same state dict
    (names and values: the construction order is timm's), and the same outputs and gradients, bit for bit, on the
    training grid and on a non-square one, routed or not."""
    routing = {"routes": [{"selection_ratio": 0.5, "start_layer_idx": 1, "end_layer_idx": 4}]} if routed else None
    nets = []
    for timm in (False, True):
        if timm:
            _timm_layers(monkeypatch)
        torch.manual_seed(0)
        nets.append(build_dit("DiT-T/4", 16, 3, 10, routing=routing, depth=6, hidden_size=64, num_heads=4,
                              init="paper").train())
    ours, theirs = nets
    assert type(ours.blocks[0].attn).__module__ == "tread.models.dit"
    assert type(theirs.blocks[0].attn).__module__.startswith("timm.")
    a, b = ours.state_dict(), theirs.state_dict()
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert ours.num_tokens == theirs.num_tokens == 16
    for shape in ((2, 3, 16, 16), (2, 3, 8, 24)):
        x, t, y = torch.randn(shape), torch.rand(2), torch.tensor([1, 10])
        outs = []
        for net in nets:
            torch.manual_seed(1)                       # the route's token draw
            out = net(x, t, y)
            out.square().mean().backward()
            outs.append(out)
        assert torch.count_nonzero(outs[0]) > 0 and torch.equal(outs[0], outs[1])
        for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
            assert torch.equal(p.grad, q.grad), name
        ours.zero_grad(), theirs.zero_grad()

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

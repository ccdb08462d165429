"""HiDream-I1 (diffusers HiDreamImageTransformer2DModel) with TREAD routing: the proofs only HiDream has (the kept
subsequence with its true RoPE ids, the running text stream and a Llama state per block; the mixture-of-experts
feed-forward sees only the kept tokens; diffusers' training-mode forward; the class table's T5 / Llama / pooled
parts; the negated output); the shared checks run for HiDream in tests/test_families.py."""
from __future__ import annotations

import pytest
import torch

import family_checks as fc
from test_families import CROSS, route
from tread.models.families import FamilyConfigError

FAMILY = "hidream"

pytestmark = pytest.mark.usefixtures("one_thread")


def per_layer_text(model, batch: int = 3, seed: int = 4, layers: int = 7) -> dict:
    """Text data as the pipeline gives it: T5 (5 tokens), pooled, and one Llama state per layer (6 tokens, another
    length than T5's), more layers than llama_layers uses (the tiny preset uses 0..5)."""
    g = torch.Generator().manual_seed(seed)
    return {"text": torch.randn(batch, 5, model.text_dim, generator=g),
            "pooled": torch.randn(batch, model.pooled_dim, generator=g),
            "llama": torch.randn(batch, layers, 6, model.llama_dim, generator=g)}


def grid_ids(h: int, w: int) -> torch.Tensor:
    """(h*w, 3) ids (0, row, col) in row-major token order, as HiDreamImagePipeline's patchify builds them."""
    rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    return torch.stack([torch.zeros(h * w), rows.flatten().float(), cols.flatten().float()], dim=1)


ROUTES = {"dual-to-single": CROSS, "single-only-to-end": [route(0.75, 3, -1)], "dual-only": [route(0.5, 0, 1)]}


@pytest.mark.parametrize("text", [False, True], ids=["class-table", "text-per-layer-llama"])
@pytest.mark.parametrize("routes", list(ROUTES.values()), ids=list(ROUTES))
def test_kept_tokens_equal_blocks_on_subsequence(routes, text):
    """3. Kept tokens after the route = diffusers' blocks (default HiDreamAttnProcessor, training-mode MoE) run on
    the kept subsequence, per sample, with RoPE from the kept tokens' own (0, row, col) ids, the running text stream
    [T5, last Llama state] and block i's own projected Llama state appended to it (dual: beside the text, single:
    after [image, text]); the text stream after the route matches too."""
    r = fc.routed_run(FAMILY, routes, cond=per_layer_text if text else None)
    model, x, t, y, seen, routed_in, route_ = r.model, r.x, r.t, r.y, r.dense, r.routed, r.route
    _, x_kept, ids, _ = r.scatter
    ref_tr = model.pristine_transformer()        # training mode, as the routed step
    cfg = ref_tr.config
    cond = model.conditioning(y, r.cond)
    llama = cond["llama"]
    state = (lambda k: llama[:, k]) if llama.dim() == 4 else (lambda k: llama)
    n_dual = cfg.num_layers
    blocks = [*ref_tr.double_stream_blocks, *ref_tr.single_stream_blocks]
    _, h_grid, w_grid = model.token_grid
    img_ids = grid_ids(h_grid, w_grid)
    with torch.no_grad():
        for b in range(x.shape[0]):
            temb = ref_tr.t_embedder(t[b:b + 1], x.dtype) + ref_tr.p_embedder(cond["pooled"][b:b + 1])
            lla = [ref_tr.caption_projection[i](state(k)[b:b + 1]) for i, k in enumerate(cfg.llama_layers)]
            t5 = ref_tr.caption_projection[-1](cond["text"][b:b + 1])
            c = seen[route_.start_layer_idx][1][b:b + 1]                    # running text stream at the route's start
            L0 = c.shape[1]
            assert L0 == t5.shape[1] + lla[-1].shape[1]
            if route_.start_layer_idx == 0:                                # [T5, the last block's Llama state]
                # projected for 1 sample here, for the whole batch in the model: float32 tolerance
                torch.testing.assert_close(c, torch.cat([t5, lla[-1]], dim=1))
            L = L0 + lla[0].shape[1]
            rope = ref_tr.pe_embedder(torch.cat([img_ids[ids[b]], torch.zeros(L, 3)])[None])   # true positions
            h = seen[route_.start_layer_idx][0][b:b + 1, ids[b]]            # dense route-start tokens, kept subset
            K = h.shape[1]
            for j in range(route_.start_layer_idx, route_.end_layer_idx + 1):
                if j < n_dual:
                    h, c = blocks[j](hidden_states=h, encoder_hidden_states=torch.cat([c, lla[j]], dim=1), temb=temb,
                                     image_rotary_emb=rope)
                    c = c[:, :L0]
                else:
                    s = blocks[j](hidden_states=torch.cat([h, c, lla[j]], dim=1), temb=temb, image_rotary_emb=rope)
                    h, c = s[:, :K], s[:, K:K + L0]
            torch.testing.assert_close(x_kept[b:b + 1], h, rtol=1e-5, atol=1e-5)
            if route_.end_layer_idx + 1 < len(blocks):
                torch.testing.assert_close(routed_in[route_.end_layer_idx + 1][1][b:b + 1], c, rtol=1e-5, atol=1e-5)
            if b == 0:   # the check has teeth: the first K grid positions instead of the true ones differ
                wrong = ref_tr.pe_embedder(torch.cat([img_ids[:K], torch.zeros(L, 3)])[None])
                h2, c2 = seen[route_.start_layer_idx][0][:1, ids[0]], seen[route_.start_layer_idx][1][:1]
                j = route_.start_layer_idx
                if j < n_dual:
                    h2 = blocks[j](hidden_states=h2, encoder_hidden_states=torch.cat([c2, lla[j]], dim=1), temb=temb,
                                   image_rotary_emb=wrong)[0]
                else:
                    h2 = blocks[j](hidden_states=torch.cat([h2, c2, lla[j]], dim=1), temb=temb,
                                   image_rotary_emb=wrong)[:, :K]
                assert not torch.allclose(routed_in[j + 1][0][:1] if j < route_.end_layer_idx else x_kept[:1], h2,
                                          rtol=1e-3, atol=1e-3)


def gate_spies(transformer):
    """Per block: the (batch, tokens) each MoE gate gets, the aux loss it returns, the rows each routed expert and
    the shared expert get."""
    log = {"gate": [], "aux": [], "experts": [], "shared": []}
    hooks = []
    for i, blk in enumerate([*transformer.double_stream_blocks, *transformer.single_stream_blocks]):
        ff = blk.block.ff_i
        def gate(m, a, out, i=i):   # forward hooks return None: the outputs stay diffusers' own
            log["gate"].append((i, tuple(a[0].shape[:2])))
            log["aux"].append((i, out[2]))

        hooks.append(ff.gate.register_forward_hook(gate))
        hooks.append(ff.shared_experts.register_forward_hook(
            lambda m, a, out, i=i: log["shared"].append((i, a[0].shape[:-1].numel()))))
        for e, expert in enumerate(ff.experts):
            hooks.append(expert.register_forward_hook(
                lambda m, a, out, i=i, e=e: log["experts"].append((i, e, a[0].shape[0]))))
    return log, hooks


def test_moe_gate_and_experts_see_only_the_kept_tokens():
    """During a route the gate's input (and so its top-k and the aux loss diffusers computes in training) holds the
    kept image tokens only in dual blocks, and the kept image tokens + the text in single blocks (diffusers' single
    blocks run the MoE over [image, text, Llama]); the experts get exactly top_k rows per such token, the shared
    expert one. Outside the route: all N tokens."""
    routes = CROSS                                   # blocks 1..5: dual 1, single 2..5
    model = fc.make(FAMILY, routes).train()
    x, t, y = fc.inputs(model)
    B, N = x.shape[0], model.num_tokens
    K = model.routing.routes[0].num_keep(N)
    text_len = model.text_len                       # class table: T5 and Llama states of text_len tokens
    single_text = 2 * text_len + text_len           # running stream [T5, Llama] + the block's Llama state
    log, hooks = gate_spies(model.transformer)
    try:
        model(x, t, y)
    finally:
        for h in hooks:
            h.remove()
    n_dual, top_k = model.transformer.config.num_layers, model.transformer.config.num_activated_experts
    expected = {i: (K if 1 <= i <= 5 else N) + (single_text if i >= n_dual else 0) for i in range(8)}
    assert K < N and dict(log["gate"]) == {i: (B, expected[i]) for i in range(8)}
    for i in range(8):
        rows = sum(n for blk, _, n in log["experts"] if blk == i)
        assert rows == B * expected[i] * top_k
        assert dict(log["shared"])[i] == B * expected[i]
    # diffusers computes the load-balancing loss in training mode (over those tokens) and discards it
    assert all(aux is not None and aux.dim() == 0 for _, aux in log["aux"])


def test_gradients_reach_every_expert_the_dense_run_trains():
    """Every routed expert of every block trains in the dense step, and still does under routing (the tiny case
    sends tokens to all 4 experts of all 8 blocks: the gate is softmax top-2 over 4 and single blocks see text)."""
    def expert_grads(routes):
        model = fc.make(FAMILY, routes).train()
        x, t, y = fc.inputs(model)
        model(x, t, y).square().mean().backward()
        return {n for n, p in model.named_parameters()
                if ".experts." in n and p.grad is not None and p.grad.abs().sum() > 0}

    dense, routed = expert_grads(None), expert_grads([route(0.5, 0, -1)])   # every block routed
    n_experts = 8 * 4 * 3                                                     # blocks x experts x (w1, w2, w3)
    assert len(dense) == n_experts and routed == dense


@pytest.mark.parametrize("llama_layers", [7, 0], ids=["per-layer", "one-state"])
def test_training_mode_forward_equals_diffusers(llama_layers):
    """diffusers' training-mode forward (the MoE's training path, the aux loss computed and dropped, the (B, C, N,
    p*p) output layout) equals ours, with text data whose Llama states are per layer (B, n, L, D) or one state (B, L,
    D) for every layer; the output is diffusers' negated (HiDreamImagePipeline: noise_pred = -noise_pred); the
    Llama layers llama_layers picks matter, the others do not."""
    model = fc.make(FAMILY).train()
    x, t, y = fc.inputs(model)
    cond = per_layer_text(model)
    if not llama_layers:
        cond["llama"] = cond["llama"][:, 0]
    ref = model.pristine_transformer()
    assert ref.training
    with torch.no_grad():
        ours = model(x, t, y, cond=cond)
        torch.testing.assert_close(ours, model.reference_forward(x, t, y, cond=cond, transformer=ref), rtol=1e-6,
                                   atol=1e-6)
        states = model.conditioning(y, cond)["llama"]
        stack = states.transpose(0, 1) if states.dim() == 4 else [states] * 6
        raw = ref.eval()(hidden_states=x, timesteps=t, encoder_hidden_states_t5=cond["text"],
                         encoder_hidden_states_llama3=stack, pooled_embeds=cond["pooled"], return_dict=False)[0]
        torch.testing.assert_close(ours, -raw, rtol=1e-5, atol=1e-5)
        if llama_layers:
            unused, used = dict(cond), dict(cond)
            unused["llama"] = cond["llama"].clone()
            unused["llama"][:, 6] = 0                           # tiny's llama_layers use layers 0..5
            torch.testing.assert_close(model(x, t, y, cond=unused), ours, rtol=0, atol=0)
            used["llama"] = cond["llama"].clone()
            used["llama"][:, 3] = 0
            assert not torch.allclose(model(x, t, y, cond=used), ours, atol=1e-4)


def test_class_table_gives_t5_llama_and_pooled():
    """Class labels -> one table each for the T5 sequence, ONE Llama sequence (the state of every Llama layer) and
    the pooled vector, all under conditioner.*; the null label (CFG) zeroes text data's T5, Llama and pooled."""
    model = fc.make(FAMILY)
    y = torch.tensor([0, 2, model.num_classes])
    out = model.conditioning(y, None)
    L = model.text_len
    assert out["text"].shape == (3, L, 32) and out["llama"].shape == (3, L, 24) and out["pooled"].shape == (3, 32)
    assert {n.split(".")[1] for n, _ in model.named_parameters() if n.startswith("conditioner.")} == \
        {"text", "llama", "pooled"}
    assert not any(n.startswith("llama") for n, _ in model.named_parameters())
    cond = per_layer_text(model)
    dropped = model.conditioning(y, cond)
    for key in ("text", "llama", "pooled"):
        assert dropped[key][2].abs().sum() == 0 and torch.equal(dropped[key][:2], cond[key][:2])


def test_missing_or_malformed_llama_states():
    """Text data without Llama states: zero Llama states of the T5 length (equal to passing them); a wrong shape
    or width is refused, naming what is allowed."""
    model = fc.make(FAMILY).eval()
    x, t, y = fc.inputs(model)
    cond = per_layer_text(model)
    del cond["llama"]
    with torch.no_grad():
        out = model(x, t, y, cond=cond)
        zeros = {**cond, "llama": torch.zeros(3, 5, model.llama_dim)}
        torch.testing.assert_close(out, model(x, t, y, cond=zeros), rtol=0, atol=0)
        for bad in (torch.zeros(3, 5, 7), torch.zeros(3, 4, 6, model.llama_dim)):
            with pytest.raises(FamilyConfigError, match=r"cond\['llama'\].*n >= 6 layers"):
                model(x, t, y, cond={**cond, "llama": bad})
    with pytest.raises(FamilyConfigError, match=r"caption_channels\[1\]=24"):
        model.check_text_data({"text": (5, 32), "pooled": 32, "llama": (6, 5, 7)}, "/data/x")

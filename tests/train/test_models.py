"""The built-in GPT: tied head, shapes, presets, config checks, and that it can learn (one process)."""
from __future__ import annotations

import pytest
import torch

from tiershard.train.models import GPT, PRESETS, Block, GPTConfig, gpt_config, lm_loss


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny matrices: more threads only contend with the other tests' ranks."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_head_is_tied_to_token_embedding():
    model = GPT(PRESETS["tiny"])
    assert model.lm_head.weight is model.transformer.wte.weight
    names = [n for n, _ in model.named_parameters()]
    assert "lm_head.weight" not in names  # one parameter, listed once
    counted = sum(p.numel() for p in model.parameters())
    assert model.num_params() == counted
    # a change through one name is seen through the other
    with torch.no_grad():
        model.transformer.wte.weight[3, 0] = 7.0
    assert model.lm_head.weight[3, 0].item() == 7.0


def test_shapes_and_blocks():
    cfg = gpt_config("tiny", n_layer=3)
    model = GPT(cfg)
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.block_size))
    logits = model(idx)
    assert logits.shape == (2, cfg.block_size, cfg.vocab_size)
    assert sum(isinstance(m, Block) for m in model.modules()) == 3
    assert model(idx[:, :5]).shape == (2, 5, cfg.vocab_size)
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, cfg.block_size + 1, dtype=torch.long))


def test_causal():
    """Changing a later token must not change earlier logits."""
    torch.manual_seed(0)
    model = GPT(PRESETS["tiny"]).eval()
    idx = torch.randint(0, 256, (1, 16))
    changed = idx.clone()
    changed[0, 10] = (changed[0, 10] + 1) % 256
    a, b = model(idx), model(changed)
    assert torch.allclose(a[:, :10], b[:, :10], atol=1e-6)
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_initial_loss_is_near_uniform():
    torch.manual_seed(0)
    model = GPT(PRESETS["tiny"])
    idx, targets = torch.randint(0, 256, (2, 4, 32))
    loss = lm_loss(model(idx), targets)
    assert abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.1


def test_overfits_a_small_batch():
    torch.manual_seed(0)
    model = GPT(PRESETS["tiny"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.randint(0, 256, (4, 33))
    x, y = data[:, :-1], data[:, 1:]
    losses = []
    for _ in range(60):
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses[::10]


def test_loss_is_fp32_for_bf16_logits():
    logits = torch.randn(2, 4, 256).bfloat16()
    assert lm_loss(logits, torch.zeros(2, 4, dtype=torch.long)).dtype == torch.float32


def test_bf16_linear_on_cpu_matches_torchs_bf16_product():
    """[Note: bf16 products on a CPU]: the fp32 product of bf16 operands, rounded, is torch's bf16 product up to
    the order of the sums: output and both gradients bf16, equal but for a few elements a bf16 ulp apart, or a few
    where the sum cancels (two fp32 orders differ by a few fp32 roundoffs of the sum of |terms|, which for a small
    result is several of its bf16 ulps: 2 on an AMD EPYC's oneDNN path)."""
    from tiershard.train.models.gpt import Linear
    torch.manual_seed(0)
    ours = Linear(176, 704).bfloat16()
    ref = torch.nn.Linear(176, 704).bfloat16()
    ref.load_state_dict(ours.state_dict())
    x = torch.randn(512, 176, dtype=torch.bfloat16)
    g = torch.randn(512, 704, dtype=torch.bfloat16)
    (xa, xb) = (x.clone().requires_grad_(), x.clone().requires_grad_())
    ya, yb = ours(xa), ref(xb)
    ya.backward(g)
    yb.backward(g)
    w, x64, g64 = ours.weight.detach().double().abs(), x.double().abs(), g.double().abs()
    terms = (x64 @ w.T + ours.bias.detach().double().abs(), g64 @ w, g64.T @ x64, g64.sum(0))  # sums of |terms|
    for (a, b), t in zip(((ya, yb), (xa.grad, xb.grad), (ours.weight.grad, ref.weight.grad),
                          (ours.bias.grad, ref.bias.grad)), terms):
        assert a.dtype == b.dtype == torch.bfloat16
        differ = a != b
        assert differ.float().mean() < 1e-3
        assert torch.all((a.double() - b.double()).abs() <= 2 ** -7 * b.double().abs() + 2 ** -20 * t)
    y32 = ours.float()(x.float())                       # fp32 modules are plain nn.Linear
    torch.testing.assert_close(y32, torch.nn.functional.linear(x.float(), ours.weight.float(), ours.bias.float()))


@pytest.mark.parametrize("bias, shape", [(True, (2, 9, 48)), (False, (7, 48))])
def test_bf16_linear_keeps_only_bf16_operands_for_backward(bias, shape):
    """[Note: bf16 products on a CPU]: backward keeps the bf16 input and the weight itself, not fp32 copies of
    them (which held an fp32 copy of every gathered weight from forward to backward), and its gradients are
    bit-equal to autograd's through ``F.linear(x.float(), w.float())``."""
    from tiershard.train.models.gpt import Linear
    torch.manual_seed(0)
    ours = Linear(48, 80, bias=bias).bfloat16()
    x = torch.randn(*shape, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(*shape[:-1], 80, dtype=torch.bfloat16)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = ours(x)
    assert saved and all(t.dtype == torch.bfloat16 for t in saved)
    assert any(t is ours.weight for t in saved)
    y.backward(g)
    x32, w32 = x.detach().clone().requires_grad_(), ours.weight.detach().clone().requires_grad_()
    b32 = ours.bias.detach().clone().requires_grad_() if bias else None
    ref = torch.nn.functional.linear(x32.float(), w32.float(), b32.float() if bias else None).bfloat16()
    ref.backward(g)
    pairs = [(y, ref), (x.grad, x32.grad), (ours.weight.grad, w32.grad)] + ([(ours.bias.grad, b32.grad)] if bias else [])
    for a, b in pairs:
        assert a.dtype == b.dtype == torch.bfloat16 and torch.equal(a, b)


def test_presets_and_overrides():
    assert PRESETS["tiny"].n_layer == 2 and PRESETS["tiny"].n_embd == 32 and PRESETS["tiny"].vocab_size == 256
    small = GPT(PRESETS["small"]).num_params()
    assert 1e6 < small < 5e6
    assert gpt_config("small", n_layer=2).n_layer == 2
    with pytest.raises(ValueError, match="unknown model preset 'huge'"):
        gpt_config("huge")
    with pytest.raises(ValueError, match="unknown model field 'layers'"):
        gpt_config("tiny", layers=3)


@pytest.mark.parametrize("bad, match", [
    (dict(n_embd=30, n_head=4), "divisible"),
    (dict(n_layer=0), "n_layer"),
    (dict(block_size=2.5), "block_size"),
    (dict(dropout=1.0), "dropout"),
])
def test_config_rejects_bad_sizes(bad, match):
    with pytest.raises(ValueError, match=match):
        GPTConfig(**bad)

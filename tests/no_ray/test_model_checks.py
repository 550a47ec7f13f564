"""The model checks its inputs once, not in every layer of every forward: the attention modules
come from ``layers.ATTENTION_MODULES`` (one entry per ``config.ATTENTIONS``), the MiTA layer
calls the unchecking ``attention.mita_attention_unchecked`` (same results as the public
``mita_attention``, bit for bit), a backend is refused where it is set, and the public
``mita_attention`` still refuses what it always did. CPU, PyTorch stages only (no kernel
build)."""

from __future__ import annotations

import pytest
import torch

import mita.attention
from mita.attention import dense_attention, mita_attention
from mita.config import ATTENTIONS, BACKENDS
from mita.hooks import NULL_HOOK
from mita.layers import ATTENTION_MODULES, DenseAttention, MiTAAttention
from mita.model import EncoderClassifier, ModelConfig, set_mita_backend

CFG = ModelConfig(vocab_size=16, num_classes=3, dim=16, depth=2, num_heads=2, ffn_dim=32,
                  num_landmarks=4, topk=3, route_topk=2)
BAD_BACKEND = f"backend must be one of {BACKENDS}, got 'gpu'"


def inputs(seed: int = 0, B: int = 2, N: int = 24) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids ``(B, N)`` and a padding mask with the last row's tail padded."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, CFG.vocab_size, (B, N), generator=g)
    mask = torch.zeros(B, N, dtype=torch.bool)
    mask[-1, N - 5:] = True
    return ids.masked_fill(mask, CFG.pad_id), mask


def qkv_of(layer, x):
    """q, k, v as the layer's forward makes them (``_MultiHeadAttention.forward``)."""
    B, N, _ = x.shape
    return layer.qkv(x).view(B, N, 3, layer.num_heads, -1).permute(2, 0, 3, 1, 4)


def test_one_module_per_attention_name():
    assert list(ATTENTION_MODULES) == list(ATTENTIONS)
    assert ATTENTION_MODULES == {"dense": DenseAttention, "mita": MiTAAttention}
    for name, cls in ATTENTION_MODULES.items():
        model = EncoderClassifier(CFG.replace(attention=name))
        assert [type(b.attn) for b in model.blocks] == [cls] * CFG.depth


def test_forward_checks_setting_and_backend_not_per_layer(monkeypatch):
    calls = {"check_setting": 0, "check_backend": 0}
    for name in calls:
        real = getattr(mita.attention, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)
        monkeypatch.setattr(mita.attention, name, counted)
    ids, mask = inputs()
    for attention in ATTENTIONS:
        model = EncoderClassifier(CFG.replace(attention=attention)).eval()
        set_mita_backend(model, "torch")
        with torch.no_grad():
            logits = model(ids, mask)
        assert logits.shape == (2, CFG.num_classes) and bool(torch.isfinite(logits).all())
    assert calls == {"check_setting": 0, "check_backend": 0}
    # the counters do see a direct call: the public function checks on every call
    q = torch.randn(1, 1, 8, 4)
    mita_attention(q, q, q, num_landmarks=2, topk=2, backend="torch")
    assert calls == {"check_setting": 1, "check_backend": 1}


def test_a_bad_backend_is_refused_where_it_is_set():
    layer = MiTAAttention(CFG, backend="torch")
    with pytest.raises(ValueError) as e:
        layer.backend = "gpu"
    assert str(e.value) == BAD_BACKEND
    assert layer.backend == "torch"  # unchanged: the next forward runs what it ran
    with pytest.raises(ValueError) as e:
        MiTAAttention(CFG, backend="gpu")
    assert str(e.value) == BAD_BACKEND
    model = EncoderClassifier(CFG)
    with pytest.raises(ValueError) as e:
        set_mita_backend(model, "gpu")
    assert str(e.value) == BAD_BACKEND
    # a dense model has no MiTA layer, and still refuses the name
    with pytest.raises(ValueError) as e:
        set_mita_backend(EncoderClassifier(CFG.replace(attention="dense")), "gpu")
    assert str(e.value) == BAD_BACKEND
    for backend in BACKENDS:
        layer.backend = backend
        assert layer.backend == backend


def test_public_mita_attention_still_checks():
    q = torch.randn(2, 1, 8, 4)
    cases = [
        (dict(num_landmarks=0, topk=2), "'num_landmarks' must be an int ≥ 1, got 0"),
        (dict(num_landmarks=2, topk=0), "'topk' must be an int ≥ 1, got 0"),
        (dict(num_landmarks=2, topk=2, route_topk=3),
         "'route_topk' s = 3 exceeds 'num_landmarks' m = 2"),
        (dict(num_landmarks=2, topk=2, shared_scale="nope"),
         "'shared_scale' must be one of ('paper', 'official'), got 'nope'"),
        (dict(num_landmarks=2, topk=2, backend="gpu"), BAD_BACKEND),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError) as e:
            mita_attention(q, q, q, **kwargs)
        assert str(e.value) == message
    with pytest.raises(ValueError) as e:
        mita_attention(q, q[:, :, :7], q, num_landmarks=2, topk=2)
    assert str(e.value) == ("expected q, k (B, H, N, d) and v (B, H, N, dv) with equal B, H, "
                            "N; got (2, 1, 8, 4), (2, 1, 7, 4), (2, 1, 8, 4)")
    empty = q[:, :, :0]
    with pytest.raises(ValueError) as e:  # N = 0 comes before the setting, as it always did
        mita_attention(empty, empty, empty, num_landmarks=0, topk=2)
    assert str(e.value) == "sequence length N must be ≥ 1"


def test_layers_give_what_the_public_functions_give():
    torch.manual_seed(0)
    _, mask = inputs(seed=1)
    x = torch.randn(*mask.shape, CFG.dim)
    for cfg in (CFG, CFG.replace(route_topk=1, shared_scale="official"),
                CFG.replace(num_landmarks=4, landmark_grid=(4, 6))):
        layer = MiTAAttention(cfg, backend="torch")
        with torch.no_grad():
            q, k, v = qkv_of(layer, x)
            got = layer.attend(q, k, v, mask, NULL_HOOK, False)
            want = mita_attention(q, k, v, num_landmarks=cfg.num_landmarks, topk=cfg.topk,
                                  route_topk=cfg.route_topk, key_padding_mask=mask,
                                  landmark_grid=cfg.landmark_grid,
                                  shared_scale=cfg.shared_scale, backend="torch")
            assert torch.equal(got, want)
            whole = layer(x, mask, check_mask=False)
            B, N, dim = x.shape
            assert torch.equal(whole, layer.out_proj(want.transpose(1, 2).reshape(B, N, dim)))
    dense = DenseAttention(CFG)
    with torch.no_grad():
        q, k, v = qkv_of(dense, x)
        assert torch.equal(dense.attend(q, k, v, mask, NULL_HOOK, False),
                           dense_attention(q, k, v, mask))


def test_the_layer_still_refuses_a_bad_mask():
    """What the layer's path checks itself: the mask, unless the caller checked it (the model
    checks it once per forward and passes check_mask=False; a direct call leaves it on)."""
    layer = MiTAAttention(CFG, backend="torch")
    x = torch.randn(2, 8, CFG.dim)
    with pytest.raises(ValueError, match="all padding"):
        layer(x, torch.tensor([[False] * 8, [True] * 8]))

"""``compat.layer_hooks``: which layers will call vLLM's per-layer KV hooks, read from the classes
of the installed vLLM (never from a model name).

The layer objects are real vLLM classes, created without running their constructors (only the
class and the ``use_direct_call`` attribute are read): the plain ``Attention`` and
``MLAAttention`` route through the decorated ops; the sparse-MLA (DeepSeek-V3.2 / GLM-5.x),
DeepSeek-V4 and Kimi K3 / Linear MLA classes override ``forward`` and do not.
"""

import importlib

import pytest

pytestmark = pytest.mark.vllm

pytest.importorskip("vllm")

from xkv.connector import compat  # noqa: E402


def _bare(module: str, cls_name: str):
    """An instance of ``module.cls_name`` without its constructor (None: not in this vLLM)."""
    try:
        cls = getattr(importlib.import_module(module), cls_name)
    except (ImportError, AttributeError):
        return None
    abstract = getattr(cls, "__abstractmethods__", frozenset())
    if abstract:  # keep the class's forward; only fill in what the ABC demands
        cls = type(cls_name, (cls,), {m: (lambda self, *a, **k: None) for m in abstract
                                      if m != "forward"})
    obj = cls.__new__(cls)
    object.__setattr__(obj, "__dict__", {})
    return obj


class _Cfg:
    def __init__(self, ctx):
        self.compilation_config = type("C", (), {"static_forward_context": ctx})()


def test_decorated_classes_fire_overriding_classes_do_not():
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    ctx = {"attn": _bare(Attention.__module__, "Attention"),
           "mla": _bare(MLAAttention.__module__, "MLAAttention")}
    ctx["mla"].__dict__["use_direct_call"] = False
    direct = _bare(MLAAttention.__module__, "MLAAttention")
    direct.__dict__["use_direct_call"] = True  # forward_impl without the decorated op
    ctx["mla_direct"] = direct
    attn_direct = _bare(Attention.__module__, "Attention")
    attn_direct.__dict__["use_direct_call"] = True  # still calls the decorated function
    ctx["attn_direct"] = attn_direct

    class Subclass(Attention):  # a custom class that overrides forward
        def forward(self, *a, **k):
            return None

    ctx["custom"] = Subclass.__new__(Subclass)
    others = {"dsa": ("vllm.models.deepseek_v32.attention", "DeepseekV32Attention"),
              "dsv4": ("vllm.models.deepseek_v4.nvidia.flashmla", "DeepseekV4FlashMLAAttention"),
              "kimi": ("vllm.models.kimi_k3.nvidia.mla", "MultiHeadLatentAttention")}
    for name, (mod, cls) in others.items():
        obj = _bare(mod, cls)
        if obj is not None:
            ctx[name] = obj
    got = compat.layer_hooks(_Cfg(ctx), [*ctx, "missing"])
    assert got["attn"] == (True, "Attention")
    assert got["attn_direct"][0] and got["mla"] == (True, "MLAAttention")
    assert got["mla_direct"][0] is False
    assert got["custom"][0] is False and "Subclass" in got["custom"][1]
    for name in others:
        if name in ctx:
            assert got[name][0] is False, name
    assert got["missing"][0] is False
    # 0.29 and 0.33 ship the three hook-skipping model classes: they must have been checked
    if compat.features()["generic_kv_views"]:
        assert set(others) <= set(ctx)
        assert got["dsa"][1] == "DeepseekV32Attention"


def test_an_undecorated_op_means_no_layer_fires(monkeypatch):
    """If the op an Attention reaches were not wrapped by the transfer decorator, no layer of
    that class is trusted to fire."""
    from vllm.model_executor.layers.attention import attention as A

    raw = A.unified_attention_with_output
    while getattr(raw, "__wrapped__", None) is not None:
        raw = raw.__wrapped__
    monkeypatch.setattr(A, "unified_attention_with_output", raw)
    ctx = {"attn": _bare(A.__name__, "Attention")}
    assert compat.layer_hooks(_Cfg(ctx), ["attn"])["attn"][0] is False


def test_layerwise_fanout_hook_follows_the_classes():
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    mla = _bare(MLAAttention.__module__, "MLAAttention")
    mla.__dict__["use_direct_call"] = False
    dsa = _bare("vllm.models.deepseek_v32.attention", "DeepseekV32Attention")
    group = type("G", (), {"layer_names": ["a", "b"], "enable_kv_transfer": True})
    kcfg = type("K", (), {"kv_cache_groups": [group]})
    assert compat.layerwise_load_hook(_Cfg({"a": mla, "b": mla}), kcfg)
    if dsa is not None:
        assert not compat.layerwise_load_hook(_Cfg({"a": mla, "b": dsa}), kcfg)

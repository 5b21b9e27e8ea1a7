"""The layout memory model (mgtutorial/perf/layout.py) and the rooflines (roofline.py) by hand,
and exercise 09a.3's checker catching the classic wrong estimates without printing the expected
value."""

from __future__ import annotations

import functools

import pytest

from mgtutorial.common import models
from mgtutorial.exercises import ExerciseError
from mgtutorial.exercises import ch09_layout as ex
from mgtutorial.perf import layout, roofline, scaling


def test_memory_per_gpu_by_hand():
    model = scaling.Transformer(layers=2, hidden=64, seq=32)  # Ψ = 12·2·64² = 98,304
    got = layout.memory_per_gpu(model, dp=4, tp=2, pp=2, recompute="none", heads=4)
    shard = 98_304 / 4  # ÷ tp·pp; DDP replicates over dp
    assert (got["params"], got["grads"], got["optimizer"]) == (4 * shard, 4 * shard, 8 * shard)
    per_layer = 32 * 1 * 64 * (10 + 24 / 2 + 5 * 4 * 32 / (64 * 2))  # Korthikanti §4, t = 2
    assert got["activations"] == pytest.approx(2 * per_layer)  # 1F1B: L layers' worth
    assert got["total"] == pytest.approx(sum(v for k, v in got.items() if k != "total"))
    fsdp = layout.memory_per_gpu(model, dp=4, tp=2, pp=2, heads=4, fsdp=True)
    assert fsdp["optimizer"] == got["optimizer"] / 4
    full = layout.activation_bytes(model, 3, 8, "full", heads=4)
    assert full == 2 * 32 * 3 * 64  # each layer's input, 16-bit
    sel = layout.activation_bytes(model, 1, 1, "selective", heads=4)
    assert sel == 32 * 64 * 34 - 32 * 64 * 0  # 10 + 24 at t = 1
    with pytest.raises(ValueError, match="recompute='some'"):
        layout.activation_bytes(model, 1, 1, "some", heads=4)
    with pytest.raises(ValueError, match="must equal 64 GPUs"):
        layout.check_layout(model, 64, 8, 4, 1, heads=4)
    with pytest.raises(ValueError, match="does not divide the 4 heads"):
        layout.check_layout(model, 24, 8, 3, 1, heads=4)


@functools.cache
def right(dp, tp, pp, recompute, attention):
    return ex.reference(dp, tp, pp, recompute, attention)


@functools.cache
def parts(v):
    return layout.memory_per_gpu(ex.MODEL, *v[:4], heads=ex.HEADS, attention=v[4])


def _warm():
    """The wrong answers below are built from the library, which the checker refuses to see
    called: their values at the checker's probes are computed (and cached) beforehand."""
    for v in ex.PROBES:
        parts(v), right(*v), right(*v[:4], "eager")


def best():
    return {a: ex.best_layouts(a)[0] for a in layout.ATTENTION}


@pytest.mark.parametrize(
    "wrong, hint",
    [
        (lambda *v: parts(v)["total"] - parts(v)["optimizer"], "Adam"),
        (lambda *v: parts(v)["total"] - parts(v)["activations"], "leaves out the activations"),
        (lambda *v: parts(v)["total"] - parts(v)["grads"], "gradients"),
        (
            lambda *v: (
                (parts(v)["total"] - parts(v)["activations"]) / v[0] + parts(v)["activations"]
            ),
            "DDP keeps a full replica",
        ),
        (
            lambda *v: parts(v)["total"] - parts(v)["activations"] * (1 - 1 / v[2]),
            "first stage keeps pp micro-batches",
        ),
        (lambda *v: parts(v)["total"] + parts(v)["grads"], "gradient_as_bucket_view=True"),
        (lambda *v: 1.5 * right(*v), "too large"),
        (lambda *v: right(*v[:4], "eager"), "keeps the s×s scores with attention='sdpa'"),
        (lambda dp, tp, pp, recompute: right(dp, tp, pp, recompute, "eager"), "TypeError"),
    ],
)
def test_layout_checker_names_the_classic_mistakes(wrong, hint):
    _warm()
    with pytest.raises(ExerciseError, match=hint) as err:
        ex.layout_choice(wrong, best())
    for a, v in best().items():
        assert f"{right(*v, a) / 1e9:.1f}" not in str(err.value)


def test_layout_checker_refuses_the_library_itself():
    def asks(*v):
        return layout.memory_per_gpu(ex.MODEL, *v[:4], heads=ex.HEADS, attention=v[4])["total"]

    with pytest.raises(ExerciseError, match="calls layout.memory_per_gpu"):
        ex.layout_choice(asks, best())


def test_layout_checker_wants_a_fitting_layout_with_fewest_gpus_per_replica(capsys):
    _warm()
    eager, sdpa = ex.best_layouts("eager"), ex.best_layouts("sdpa")
    assert all(v[1] * v[2] == 8 and v[3] == "selective" for v in eager)  # by the model
    assert [v[:3] for v in sdpa] == [v[:3] for v in eager]  # the same replicas ...
    assert all(v[3] == "none" for v in sdpa)  # ... without recomputation: no s² scores kept
    for wrong, hint in [
        ((64, 1, 1, "none"), "needs more than 80 GB"),
        ((4, 8, 2, "full"), "fewer GPUs per replica"),
        ((8, 16, 1, "none"), "cannot run"),
    ]:
        with pytest.raises(ExerciseError, match=hint):
            ex.layout_choice(right, {"eager": wrong, "sdpa": sdpa[0]})
    with pytest.raises(ExerciseError, match='chosen\\["sdpa"\\].*no s×s scores are kept'):
        ex.layout_choice(right, {"eager": eager[0], "sdpa": eager[0]})  # the eager answer
    with pytest.raises(ExerciseError, match="a dict"):
        ex.layout_choice(right, eager[0])
    ex.layout_choice(right, {"eager": eager[0], "sdpa": sdpa[0]})
    assert capsys.readouterr().out.startswith("✓ 09a.3 layout")


def test_sdpa_drops_the_scores_term_only():
    model = scaling.Transformer(layers=2, hidden=64, seq=32)
    eager = layout.activation_bytes(model, 1, 2, "none", heads=4)
    sdpa = layout.activation_bytes(model, 1, 2, "none", heads=4, attention="sdpa")
    sel = layout.activation_bytes(model, 1, 2, "selective", heads=4)
    assert eager - sel == 32 * 5 * 4 * 32 / 2  # s·5·a·s/t: the s×s probabilities, mask, dropout
    assert sdpa - sel == 32 * 4 * 4 / 2  # s·4·a/t: one fp32 logsumexp per row and head
    with pytest.raises(ValueError, match="attention='flash'"):
        layout.activation_bytes(model, 1, 1, "none", heads=4, attention="flash")


def test_attention_saved_bytes_grow_with_s_squared_only_when_eager():
    from mgtutorial.sharding import recompute

    small, large = recompute.attention_saved_bytes(64), recompute.attention_saved_bytes(128)
    assert small["eager"] == 4 * 64 * 64 * 4  # (1, 4, s, s) float32 probabilities
    assert large["eager"] == 4 * small["eager"]
    assert small["sdpa"] == 4 * 64 * 16 * 4 + 4 * 64 * 4  # output + logsumexp
    assert large["sdpa"] == 2 * small["sdpa"]


def test_roofline_arithmetic_by_hand():
    assert roofline.ridge(100e9, 10e9) == 10.0
    # 2 ms of communication; 1 MFLOP per sample at 1 GFLOP/s = 1 ms per sample
    assert roofline.comm_bound_batch(2e-3, 1e6, 1e9) == pytest.approx(2.0)
    assert roofline.comm_bound_batch(2e-3, 1e6, 1e9, hidden_share=0.5) == pytest.approx(4.0)
    # TP: 2 all-reduces of T·h·4 bytes against 6·T·8h²/tp FLOPs; with α = 0 the tokens cancel
    r = roofline.tp_ratio(1024, 4096, 2, 0.0, 1e-9, 1e11)
    assert r == pytest.approx(1e-9 * 1e11 * 2 / (6 * 1024))
    assert roofline.tp_ratio(1024, 8192, 2, 0.0, 1e-9, 1e11) == pytest.approx(r)


def test_l3_size_is_read_or_none():
    size = roofline.l3_bytes()
    assert size is None or size >= 2**20


def test_cnn_kernels_count_flops_and_bytes():
    rows = {r["name"]: r for r in roofline.cnn_kernels(models.ArticleCNN(), batch=2, repeats=1)}
    assert list(rows) == ["conv1", "relu", "max_pool", "fc1", "fc2"]
    assert rows["conv1"]["flops"] == scaling.conv2d_flops(2, 3, 32, 5, 28, 28)
    assert rows["fc1"]["flops"] == scaling.linear_flops(2, 6272, 64)
    assert rows["relu"]["bytes"] == 2 * 2 * 32 * 28 * 28 * 4  # read and write once, float32
    assert all(
        r["intensity"] == r["flops"] / r["bytes"] and r["seconds"] > 0 for r in rows.values()
    )


def test_memory_bandwidth_is_the_best_stream_and_refuses_nothing_to_time(monkeypatch):
    seconds = iter([4.0, 2.0, 3.0, 1.0, 8.0, 8.0])  # copy, relu out=, relu at 1 KiB; at 2 KiB
    monkeypatch.setattr(roofline, "_timed", lambda call, repeats: next(seconds))
    # read + write: 2 × 1024 B in 2 s, 2 × 2048 B in 1 s → the best is 4096 B/s
    assert roofline.memory_bandwidth([1024, 2048], repeats=3) == 4096.0
    with pytest.raises(ValueError, match="sizes=\\[\\]"):
        roofline.memory_bandwidth([])

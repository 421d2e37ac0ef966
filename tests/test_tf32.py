"""convtune.tf32: PyTorch's TF32 switches read and set whichever of its interfaces the user set them with."""

from __future__ import annotations

import itertools

import pytest
import torch

from convtune import tf32

PER_OPERATION = hasattr(torch.backends.cudnn, "conv") and hasattr(torch.backends.cuda.matmul, "fp32_precision")
SCOPES = {"backends": lambda: torch.backends, "cudnn": lambda: torch.backends.cudnn,
          "conv": lambda: torch.backends.cudnn.conv, "rnn": lambda: torch.backends.cudnn.rnn,
          "matmul": lambda: torch.backends.cuda.matmul, "onednn matmul": lambda: torch.backends.mkldnn.matmul}
if not hasattr(torch.backends.mkldnn, "matmul"):
    del SCOPES["onednn matmul"]


def _matmul_precision() -> str:
    try:
        return torch.get_float32_matmul_precision()
    except RuntimeError:  # (PyTorch's interfaces mixed)
        return "raises"


def state() -> dict:
    """Every switch a user can read: each flag (or that reading it raises) and each precision."""
    out: dict = {}
    for name in ("cudnn", "matmul"):
        try:
            out[f"{name}.allow_tf32"] = SCOPES[name]().allow_tf32
        except RuntimeError:
            out[f"{name}.allow_tf32"] = "raises"
    if PER_OPERATION:
        out.update({f"{name}.fp32_precision": scope().fp32_precision for name, scope in SCOPES.items()})
    out["cudnn.enabled"] = torch.backends.cudnn.enabled
    out["float32 matmul precision"] = _matmul_precision()
    return out


def user_settings() -> dict:
    """How a user may have set TF32 (a name, and what to set), both interfaces."""
    settings = {"as PyTorch starts": [],
                "flags on": [("cudnn", "allow_tf32", True), ("matmul", "allow_tf32", True)],
                "flags off": [("cudnn", "allow_tf32", False), ("matmul", "allow_tf32", False)]}
    if PER_OPERATION:
        settings |= {"PyTorch's precision tf32": [("backends", "fp32_precision", "tf32")],
                     "PyTorch's precision ieee": [("backends", "fp32_precision", "ieee")],
                     "cuDNN's precision tf32": [("cudnn", "fp32_precision", "tf32")],
                     "convolutions ieee, RNNs tf32": [("conv", "fp32_precision", "ieee"),
                                                      ("rnn", "fp32_precision", "tf32")],
                     "convolutions tf32, RNNs ieee": [("conv", "fp32_precision", "tf32"),
                                                      ("rnn", "fp32_precision", "ieee")],
                     "matrix products tf32": [("matmul", "fp32_precision", "tf32")],
                     "flags on, then PyTorch's precision ieee": [("cudnn", "allow_tf32", True),
                                                                ("matmul", "allow_tf32", True),
                                                                ("backends", "fp32_precision", "ieee")],
                     # (setting cuDNN's flag sets the RNNs' precision too, which cudnn_conv must put back)
                     "cuDNN's flag off, RNNs ieee, PyTorch's precision tf32": [
                         ("cudnn", "allow_tf32", False), ("backends", "fp32_precision", "tf32"),
                         ("conv", "fp32_precision", "ieee"), ("rnn", "fp32_precision", "ieee")],
                     # ('medium': a precision no flag has, which putting the flag back would make 'high')
                     "float32 matmul precision medium": [(None, "set_float32_matmul_precision", "medium")]}
    settings["float32 matmul precision high"] = [(None, "set_float32_matmul_precision", "high")]
    return settings


def apply(setting: str) -> None:
    for scope, name, value in user_settings()[setting]:
        if scope is None:
            getattr(torch, name)(value)
        else:
            setattr(SCOPES[scope](), name, value)


@pytest.fixture
def restored():
    """PyTorch's switches put back as they were after the test, whatever it set: the flags first (setting one sets
    its operation's precision too), then each precision, parents first, as the switches do ('none' where that
    resolves the same)."""
    cudnn, matmul = torch.backends.cudnn, torch.backends.cuda.matmul
    flags = [(matmul, matmul.allow_tf32), (cudnn, cudnn.allow_tf32)]
    enabled = cudnn.enabled
    precisions = [(scope(), scope().fp32_precision) for scope in SCOPES.values()] if PER_OPERATION else []
    matmul_precision = torch.get_float32_matmul_precision()
    before = state()
    yield
    for scope, value in flags:
        scope.allow_tf32 = value
    cudnn.enabled = enabled
    torch.set_float32_matmul_precision(matmul_precision)
    for scope, value in precisions:
        scope.fp32_precision = "none"
        if scope.fp32_precision != value:
            scope.fp32_precision = value
    assert state() == before  # (so that no test sees another's settings)


@pytest.mark.parametrize("setting, allowed", list(itertools.product(user_settings(), (True, False))))
def test_each_switch_holds_inside_and_puts_back_what_it_found(restored, setting, allowed):
    apply(setting)
    torch.backends.cudnn.enabled = False
    before = state()
    with tf32.cudnn_conv(allowed):
        assert tf32.conv_allowed() is allowed and torch.backends.cudnn.enabled
    assert state() == before
    with tf32.matmul("cuda", allowed):
        assert tf32.matmul_allowed() is allowed
    assert state() == before
    with pytest.raises(ZeroDivisionError), tf32.cudnn_conv(allowed), tf32.matmul("cuda", allowed):
        raise ZeroDivisionError  # put back also when the block raises
    assert state() == before


def test_a_precision_set_through_the_newer_interface_is_read_where_the_flags_raise(restored):
    if not PER_OPERATION:
        pytest.skip("a PyTorch without per-operation precisions")
    for name in ("cudnn", "conv", "rnn", "matmul"):
        SCOPES[name]().fp32_precision = "none"  # deferring to PyTorch's precision
    torch.backends.fp32_precision = "tf32"
    with pytest.raises(RuntimeError):
        torch.backends.cuda.matmul.allow_tf32  # noqa: B018  (the flag this test is about)
    assert tf32.matmul_allowed() and tf32.conv_allowed()
    torch.backends.fp32_precision = "ieee"
    assert not tf32.matmul_allowed() and not tf32.conv_allowed()


def test_cudnn_conv_leaves_cudnns_other_switches(restored):
    # torch.backends.cudnn.flags would set benchmark mode, determinism and (on newer PyTorch) the depthwise kernel's
    # choice to its own defaults while inside
    cudnn = torch.backends.cudnn
    saved = cudnn.benchmark, cudnn.deterministic
    try:
        cudnn.benchmark, cudnn.deterministic = True, True
        with tf32.cudnn_conv(not tf32.conv_allowed()):
            assert (cudnn.benchmark, cudnn.deterministic) == (True, True)
    finally:
        cudnn.benchmark, cudnn.deterministic = saved


def test_matmul_is_a_no_op_on_the_cpu_and_where_already_as_asked():
    assert tf32.matmul("cpu", not tf32.matmul_allowed()) is tf32.matmul("cuda", tf32.matmul_allowed())


def test_a_worker_process_is_handed_tf32_as_it_holds_whichever_interface_set_it(restored):
    # isolation hands its worker PyTorch's switches; reading the matrix products' flag raised where a user had set
    # PyTorch's precision through the newer interface
    from convtune import isolation

    if PER_OPERATION:
        for name in ("cudnn", "conv", "rnn", "matmul"):
            SCOPES[name]().fp32_precision = "none"
        torch.backends.fp32_precision = "tf32"
    else:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    state = isolation._state()
    assert state["matmul_tf32"] is True and state["cudnn"][1] is True


def test_settings_say_which_switches_a_run_would_change_now(restored):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = True
    assert tf32.Settings(matmul=True).changes("cuda") == ["the matrix products' TF32 on"]
    assert tf32.Settings(matmul=False).changes("cuda") == []
    assert tf32.Settings(conv=True).changes("cuda") == []
    assert tf32.Settings(conv=False, matmul=True).changes("cuda") == ["cuDNN on, its convolutions' TF32 off",
                                                                      "the matrix products' TF32 on"]
    torch.backends.cudnn.enabled = False  # torch:native turns cuDNN on for its call
    assert tf32.Settings(conv=True).changes("cuda") == ["cuDNN on, its convolutions' TF32 on"]
    assert tf32.Settings(conv=False, matmul=True).changes("cpu") == []  # (the CPU has none of them)
    with tf32.Settings(conv=False, matmul=True).switched("cuda"):
        assert (tf32.conv_allowed(), tf32.matmul_allowed(), torch.backends.cudnn.enabled) == (False, True, True)
    assert (tf32.conv_allowed(), tf32.matmul_allowed(), torch.backends.cudnn.enabled) == (True, False, False)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_each_algorithm_that_switches_tf32_declares_what_it_switches_to(dtype):
    # find reads the declaration (the background worker does not measure a run that would switch them): each
    # algorithm whose run switches says so, as its run does it (gemm.py, direct.py, fft.py, winograd.py, native.py)
    from convtune import get_algorithm
    from convtune.algorithms.microbatch import MicroBatch

    p = ct_problem(dtype, allow_tf32=False)
    gemm = tf32.Settings() if dtype != "float32" else tf32.Settings(matmul=False)
    expected = {"gemm:1x1": gemm, "gemm:1x1_strided": gemm, "gemm:im2col": gemm, "gemm:im2col_chunk4": gemm,
                "direct:taps": gemm, "fft:rfft": tf32.Settings(matmul=False),
                "winograd:f2x3": tf32.Settings(matmul=False), "torch:native": tf32.Settings(conv=False),
                "triton:depthwise_fwd_p64c32w4": tf32.Settings()}
    for name, settings in expected.items():
        assert get_algorithm(name).tf32_settings(p) == settings, name
    assert MicroBatch("gemm:1x1", [(1, 2)]).tf32_settings(p) == gemm


def ct_problem(dtype: str, allow_tf32: bool):
    from convtune import ConvProblem

    return ConvProblem("fwd", n=2, c=4, k=4, input_size=(6, 6), kernel_size=1, dtype=dtype, device="cuda",
                       allow_tf32=allow_tf32)


def test_one_thread_switches_at_a_time_so_overlapping_switches_leave_nothing_behind(restored):
    # Two threads' overlapping switches each put back what the other had set: a layer of allow_tf32=True in the
    # caller and an FFT candidate (TF32 off) in another thread left the matrix products' TF32 on for good.
    import threading
    import time

    torch.backends.cuda.matmul.allow_tf32 = False
    events: list[str] = []
    inside = threading.Event()

    def first():
        with tf32.matmul("cuda", True):
            inside.set()
            time.sleep(0.2)
            events.append("first out")

    def second():
        inside.wait(5)
        with tf32.matmul("cuda", False):  # (a switch: the first thread's is on)
            events.append("second in")

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert events == ["first out", "second in"] and tf32.matmul_allowed() is False


def test_a_thread_that_may_not_switch_is_refused_where_a_switch_is_needed_only(restored):
    # (the background worker's thread: the caller's work runs meanwhile under whatever it switched)
    torch.backends.cuda.matmul.allow_tf32 = False
    with tf32.refused_here():
        with tf32.matmul("cuda", False), tf32.matmul("cpu", True), tf32.cudnn_conv(tf32.conv_allowed()):
            pass  # nothing to switch
        with pytest.raises(tf32.SwitchRefused, match="may not"), tf32.matmul("cuda", True):
            pass
        with pytest.raises(tf32.SwitchRefused), tf32.cudnn_conv(not tf32.conv_allowed()):
            pass
        torch.backends.cudnn.enabled = False
        with pytest.raises(tf32.SwitchRefused, match="cuDNN switch"), tf32.cudnn_conv(tf32.conv_allowed()):
            pass
    torch.backends.cudnn.enabled = True
    with tf32.matmul("cuda", True):  # (this thread may switch again)
        assert tf32.matmul_allowed()

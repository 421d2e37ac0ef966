import pytest
import torch
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

import convtune as ct
from convtune.problem import is_in_layout


def make(**kw):
    base = dict(direction="fwd", n=2, c=4, k=6, input_size=(9, 9), kernel_size=(3, 3))
    base.update(kw)
    return ct.ConvProblem(**base)


def test_output_size_flops_and_bytes_follow_the_formulas():
    p = make(n=32, c=64, k=128, input_size=(56, 56), kernel_size=3, stride=2, padding=1, dtype="float16")
    assert p.output_size == (28, 28)
    assert p.flops == 2 * 32 * 128 * 28 * 28 * 64 * 9
    assert p.min_bytes == 2 * (32 * 64 * 56 * 56 + 128 * 64 * 9 + 32 * 128 * 28 * 28)


def test_scalars_broadcast_and_aliases_normalize():
    p = make(input_size=(5, 7, 9), kernel_size=3, stride=2, padding=1, dilation=1, layout="NDHWC", dtype="fp16")
    assert p.kernel_size == (3, 3, 3) and p.stride == (2, 2, 2)
    assert p.layout == "channels_last" and p.dtype == "float16"
    assert make(dtype=torch.bfloat16, device=torch.device("cpu")).dtype == "bfloat16"
    assert make(input_size=10, kernel_size=3).input_size == (10,)


@pytest.mark.parametrize("kw, words", [
    (dict(n=0), ["n=0", ">= 1"]),
    (dict(c=-3), ["c=-3"]),
    (dict(c=6, groups=4), ["c=6", "groups=4"]),
    (dict(k=5, groups=2, c=4), ["k=5", "groups=2"]),
    (dict(kernel_size=(11, 3)), ["kernel_size", "padded input_size"]),
    (dict(kernel_size=3, dilation=5), ["dilation", "spans"]),
    (dict(stride=0), ["stride", ">= 1"]),
    (dict(padding=-1), ["padding", ">= 0"]),
    (dict(kernel_size=(3, 3, 3)), ["kernel_size", "dimension"]),
    (dict(input_size=(1, 2, 3, 4)), ["input_size", "1, 2 or 3"]),
    (dict(input_size=(0, 9)), ["input_size", ">= 1"]),
    (dict(dtype="float64"), ["dtype='float64'", "float32"]),
    (dict(layout="NCWH"), ["layout='NCWH'", "channels_last"]),
    (dict(direction="backward"), ["direction='backward'", "bwd_data"]),
    (dict(device="tpu"), ["device='tpu'", "cuda"]),
])
def test_invalid_fields_raise_value_error_naming_field_and_value(kw, words):
    with pytest.raises(ValueError) as err:
        make(**kw)
    for word in words:
        assert word in str(err.value)


@pytest.mark.parametrize("kw", [dict(n=2.5), dict(kernel_size="3"), dict(allow_tf32="yes"), dict(groups=True)])
def test_wrong_types_raise_type_error(kw):
    with pytest.raises(TypeError):
        make(**kw)


problems = st.builds(
    lambda d, nd, n, cg, kg, g, size, r, s, p, dil, dtype, layout, tf32: ct.ConvProblem(
        direction=d, n=n, c=cg * g, k=kg * g, groups=g, input_size=(size + dil * (r - 1),) * nd,
        kernel_size=(r,) * nd, stride=s, padding=p, dilation=dil, dtype=dtype, layout=layout, allow_tf32=tf32),
    st.sampled_from(["fwd", "bwd_data", "bwd_filter"]), st.integers(1, 3), st.integers(1, 64),
    st.integers(1, 64), st.integers(1, 64), st.integers(1, 8), st.integers(1, 40), st.integers(1, 7),
    st.integers(1, 4), st.integers(0, 3), st.integers(1, 3), st.sampled_from(["float32", "float16", "bfloat16"]),
    st.sampled_from(["NCHW", "channels_last"]), st.booleans(),
)


@given(problems)
@hsettings(max_examples=200, deadline=None)
def test_key_round_trips_and_is_stable(p):
    assert ct.ConvProblem.from_key(p.key) == p
    assert hash(ct.ConvProblem.from_key(p.key)) == hash(p)
    assert all(o >= 1 for o in p.output_size)


@pytest.mark.parametrize("key", ["", "fwd|n1", "fwd|n1|c1|k1|in5|r3|s1|p0|d1|g1|float64|channels_first|cpu|tf32=1", 42])
def test_from_key_rejects_malformed_keys(key):
    with pytest.raises(ValueError):
        ct.ConvProblem.from_key(key)


@pytest.mark.parametrize("direction", ["fwd", "bwd_data", "bwd_filter"])
@pytest.mark.parametrize("layout", ["channels_first", "channels_last"])
@pytest.mark.parametrize("nd", [1, 2, 3])
def test_random_inputs_have_shapes_dtype_layout_and_are_not_zero(direction, layout, nd):
    p = make(direction=direction, layout=layout, input_size=(6,) * nd, kernel_size=3, dtype="bfloat16", groups=2)
    a, b = p.random_inputs(seed=3)
    shapes = p.operand_shapes
    for t, shape in zip((a, b), shapes[:2]):
        assert tuple(t.shape) == shape and t.dtype == torch.bfloat16
        assert is_in_layout(t, layout)
        assert t.abs().sum() > 0
    a2, _ = p.random_inputs(seed=3)
    assert torch.equal(a, a2)
    assert not torch.equal(a, p.random_inputs(seed=4)[0])


@pytest.mark.parametrize("module, shape", [
    (torch.nn.Conv1d(4, 8, 5, stride=2, padding=2, dilation=1), (3, 4, 50)),
    (torch.nn.Conv2d(6, 12, (3, 5), stride=(1, 2), padding=(1, 2), groups=3), (2, 6, 20, 30)),
    (torch.nn.Conv2d(8, 8, 3, padding=1, groups=8, bias=False), (2, 8, 16, 16)),
    (torch.nn.Conv3d(2, 4, 3, padding=1, dilation=2), (1, 2, 9, 9, 9)),
    (torch.nn.Conv2d(3, 5, 3, padding="same"), (2, 3, 10, 10)),
    (torch.nn.Conv2d(3, 5, 4, padding="same"), (2, 3, 10, 10)),
    (torch.nn.Conv2d(3, 5, 3, padding=1, padding_mode="reflect"), (2, 3, 10, 10)),
    (torch.nn.Conv2d(3, 5, 3, padding="valid"), (2, 3, 10, 10)),
])
@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel lengths")
def test_from_module_matches_the_module_output_shape_and_flops(module, shape):
    p = ct.ConvProblem.from_module(module, shape)
    y = module(torch.randn(shape))
    assert p.y_shape == tuple(y.shape)
    assert p.w_shape == tuple(module.weight.shape)
    assert p.dtype == "float32" and p.device == "cpu"
    assert ct.ConvProblem.from_module(module, shape, direction="bwd_filter").direction == "bwd_filter"


def test_from_module_rejects_other_modules_and_bad_shapes():
    with pytest.raises(TypeError):
        ct.ConvProblem.from_module(torch.nn.Linear(3, 4), (1, 3))
    with pytest.raises(TypeError):
        ct.ConvProblem.from_module(torch.nn.ConvTranspose2d(3, 4, 3), (1, 3, 8, 8))
    with pytest.raises(ValueError, match="channels"):
        ct.ConvProblem.from_module(torch.nn.Conv2d(3, 4, 3), (1, 5, 8, 8))
    with pytest.raises(ValueError, match="spatial"):
        ct.ConvProblem.from_module(torch.nn.Conv2d(3, 4, 3), (1, 3, 8))


def test_to_layout_converts_1d_2d_3d():
    for shape in [(2, 3, 7), (2, 3, 7, 5), (2, 3, 4, 5, 6)]:
        t = torch.randn(shape)
        cl = ct.to_layout(t, "channels_last")
        assert is_in_layout(cl, "channels_last") and torch.equal(cl, t)
        assert ct.to_layout(t, "NCHW") is t


@pytest.mark.parametrize("field, value, error", [
    ("kernel_size", {3: 1, 5: 2}, TypeError),  # a dict's keys are no sizes
    ("input_size", {8, 9}, TypeError),  # nor an unordered set
    ("n", 2**70, ValueError),  # beyond any real batch (and int64)
    ("input_size", (2**40, 8), ValueError),
    ("device", "cpu:garbage", ValueError),
])
def test_sizes_and_devices_that_name_no_convolution_are_refused(field, value, error):
    fields = dict(direction="fwd", n=1, c=2, k=2, input_size=(8, 8), kernel_size=3) | {field: value}
    with pytest.raises(error, match=field if field != "device" else "device"):
        ct.ConvProblem(**fields)


def test_a_problem_whose_operands_no_tensor_can_hold_is_refused_naming_the_operand():
    big = 2**31 - 1  # each size is allowed alone; together the input takes about 1.7e38 bytes
    with pytest.raises(ValueError, match=r"input \(2147483647, 2147483647, 2147483647, 2147483647\).*8 EiB"):
        ct.ConvProblem("fwd", n=big, c=big, k=1, input_size=(big, big), kernel_size=1)
    ct.ConvProblem("fwd", n=big, c=1, k=1, input_size=(1, 1), kernel_size=1)  # large, but a tensor can hold it


def test_a_tensor_for_a_shape_or_a_seed_that_is_not_an_integer_is_refused_by_name():
    conv = torch.nn.Conv2d(3, 8, 3)
    with pytest.raises(TypeError, match=r"got a tensor of shape \(2, 3, 9, 9\): pass x.shape"):
        ct.ConvProblem.from_module(conv, torch.randn(2, 3, 9, 9))
    p = ct.ConvProblem.from_module(conv, (2, 3, 9, 9))
    for seed in ("a", 1.5, True):
        with pytest.raises(TypeError, match=r"random_inputs\(seed=...\) takes an integer"):
            p.random_inputs(seed=seed)
    assert torch.equal(p.random_inputs(seed=3)[0], p.random_inputs(seed=3)[0])


@pytest.mark.parametrize("field", ["tolerance", "max_rel_error", "budget_s", "deadline_s"])
def test_a_policy_number_too_large_for_a_float_is_refused_naming_the_field(field):
    # (math.isfinite raised OverflowError: neither ValueError nor TypeError, and naming nothing)
    with pytest.raises(ValueError, match=rf"Policy.{field} is an integer of 1329 bits, more than a float holds"):
        ct.Policy(**{field: 10**400})
    assert getattr(ct.Policy(**{field: 2**1023 if field != "tolerance" else 0}), field) >= 0  # a float holds it


KEY = "fwd|n1|c1|k1|in5|r3|s1|p0|d1|g1|float32|channels_first|cpu|tf32=1"


@pytest.mark.parametrize("key", [KEY + "\n", KEY.replace("in5", "in\u0665"), KEY.replace("n1", "n" + "9" * 5000),
                                 "x" * 100_000])
def test_from_key_refuses_what_no_key_holds_naming_the_key(key):
    # A trailing newline and other scripts' digits were read as if absent and as 0-9; a 5000-digit batch raised
    # Python's own "Exceeds the limit (4300 digits) for integer string conversion", naming no key.
    assert ct.ConvProblem.from_key(KEY).key == KEY
    with pytest.raises(ValueError, match="is not a ConvProblem key") as raised:
        ct.ConvProblem.from_key(key)
    assert len(str(raised.value)) < 400  # the key shown in part: a long one ends in logs

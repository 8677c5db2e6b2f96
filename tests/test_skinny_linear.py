"""ops_cuda.skinny_linear: x @ weight.T for a decode step's few rows, against float64 matmuls; opcheck; the CUDA
kernel at every row count it takes (1, 2, 3 and 4 m16 tiles, rows past M), split and unsplit K, the shapes of
Qwen3's projections, bitwise the same result at every call and under a CUDA graph, and its refusals."""
import pytest
import torch
from conftest import OpLog

import ops_cuda
from ops_cuda import library
from ops_cuda.skinny_linear import MAX_ROWS, ROUTED_ROWS


def operands(m, k, n, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g, dtype=torch.float64)
    w = torch.randn(n, k, generator=g, dtype=torch.float64) / k ** 0.5
    return x.to(device=device, dtype=dtype), w.to(device=device, dtype=dtype)


def float64_product(x, w):
    """On x's device: float64 matmuls on the GPU keep the reference from costing seconds a case."""
    return (x.double() @ w.double().T).cpu()


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_cpu_reference_is_the_product(dtype, tol):
    x, w = operands(5, 96, 40, dtype)
    got = ops_cuda.skinny_linear(x, w)
    assert got.dtype == dtype and got.shape == (5, 40)
    want = float64_product(x, w)
    assert (got.double() - want).abs().max() <= tol * want.abs().max()


def test_opcheck():
    x, w = operands(3, 64, 128, torch.float32)
    torch.library.opcheck(torch.ops.fw.skinny_linear.default, (x, w))


def test_bad_arguments_name_the_argument():
    x, w = operands(3, 64, 128, torch.float32)
    with pytest.raises(ValueError, match="skinny_linear: `x` must be \\[M, K\\]"):
        ops_cuda.skinny_linear(x[0], w)
    with pytest.raises(ValueError, match="must be \\[M, K\\] and \\[N, K\\]"):
        ops_cuda.skinny_linear(x, w[:, 1:])
    with pytest.raises(ValueError, match="must share a dtype"):
        ops_cuda.skinny_linear(x, w.double())


@pytest.fixture()
def kernels():
    """The CUDA tests are the kernel's only if the extension loaded: otherwise the reference serves CUDA too."""
    backend = library.activate_cuda()
    assert backend == "kernels", f"the CUDA extension did not load: {library.cuda_state['error']}"


SHAPES = [
    (64, 64),        # one chunk of K: one split whatever the row count
    (2048, 1024),    # Qwen3-0.6B's o projection
    (3072, 1024),    # its down projection
    (1024, 4096),    # its qkv projection
    (4096, 2560),    # Qwen3-4B's o projection
    (9728, 2560),    # its down projection
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k, n", SHAPES)
@pytest.mark.parametrize("m", [1, 7, 16, 17, 33, 48, MAX_ROWS])
def test_cuda_against_float64(dtype, k, n, m, kernels):
    x, w = operands(m, k, n, dtype, "cuda", seed=m)
    got = ops_cuda.skinny_linear(x, w)
    assert got.dtype == dtype and got.shape == (m, n) and got.is_contiguous()
    want = float64_product(x, w)
    # float32 accumulation and one rounding to 16 bits, as cuBLAS's product of the same operands (the yardstick)
    cublas = (torch.nn.functional.linear(x, w).double().cpu() - want).abs().max()
    err = (got.double().cpu() - want).abs().max()
    assert err <= max(2 * cublas, 4e-3 * want.abs().max()), (err, cublas)
    assert torch.equal(ops_cuda.skinny_linear(x, w), got)   # the split order is fixed: the same bits


@pytest.mark.gpu
@pytest.mark.parametrize("splits", ["1", "5", "8", "40"])
def test_cuda_any_split_count_gives_the_product(splits, monkeypatch, kernels):
    """FW_SKINNY_SPLITS (the benchmark's override) is read per call: unsplit, a cluster of five uneven splits of K's
    48 chunks, the largest cluster, and a count above it (clamped to 8)."""
    monkeypatch.setenv("FW_SKINNY_SPLITS", splits)
    x, w = operands(20, 3072, 1024, torch.bfloat16, "cuda")
    got = ops_cuda.skinny_linear(x, w)
    want = float64_product(x, w)
    assert (got.double().cpu() - want).abs().max() <= 4e-3 * want.abs().max()


@pytest.mark.gpu
def test_cuda_graph_replays_give_the_eager_result(kernels):
    """Each replay writes the whole output again (it is NaN before each), from the inputs' current values."""
    x, w = operands(48, 3072, 1024, torch.bfloat16, "cuda")
    eager = ops_cuda.skinny_linear(x, w)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ops_cuda.skinny_linear(x, w)   # outside the capture: the counters' buffer exists before it
        with torch.cuda.graph(graph, stream=stream):
            out = ops_cuda.skinny_linear(x, w)
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(3):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
    x2, _ = operands(48, 3072, 1024, torch.bfloat16, "cuda", seed=9)
    x.copy_(x2)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, ops_cuda.skinny_linear(x2, w))


@pytest.mark.gpu
def test_cuda_opcheck_and_refusals(kernels):
    x, w = operands(9, 1024, 2048, torch.bfloat16, "cuda")
    torch.library.opcheck(torch.ops.fw.skinny_linear.default, (x, w))
    with pytest.raises(RuntimeError, match="takes 1 to 64 rows"):
        torch.ops.fw.skinny_linear(torch.zeros(65, 1024, dtype=torch.bfloat16, device="cuda"), w)
    with pytest.raises(RuntimeError, match="multiples of 64"):
        torch.ops.fw.skinny_linear(x[:, :1000], w[:, :1000])
    with pytest.raises(RuntimeError, match="bfloat16 or float16"):
        torch.ops.fw.skinny_linear(x.float(), w.float())
    with pytest.raises(RuntimeError, match="must be a CUDA tensor"):
        torch.ops.fw.skinny_linear(x, w.cpu())


def test_linear_is_f_linear_off_cuda():
    """`ops_cuda.linear` (the paged forward's projections) takes cuBLAS's or the CPU's F.linear wherever the kernel
    does not apply: the same bits."""
    from ops_cuda.skinny_linear import skinny_fits

    x, w = operands(4, 128, 64, torch.bfloat16)
    assert not skinny_fits(x, w)
    assert torch.equal(ops_cuda.linear(x, w), torch.nn.functional.linear(x, w))


def routed(x, w):
    with OpLog() as log:
        out = ops_cuda.linear(x, w)
    return "fw.skinny_linear" in log.ops, out


@pytest.mark.gpu
def test_cuda_linear_routes_a_few_rows_onto_the_hidden_state_to_the_kernel(kernels, monkeypatch):
    """Up to ROUTED_ROWS rows of one 16-bit dtype, K and N multiples of 64, no gradient, an output no wider than the
    input: fw's kernel; anything else: F.linear, which also takes a gradient and autocast's casts."""
    x, w = operands(ROUTED_ROWS, 2048, 1024, torch.bfloat16, "cuda")
    took, out = routed(x, w)
    assert took and torch.equal(out, ops_cuda.skinny_linear(x, w))
    assert routed(x[:1], w)[0] and routed(x.half(), w.half())[0]
    assert not routed(torch.cat([x, x[:1]]), w)[0]              # one row more
    assert not routed(x.float(), w.float())[0]                   # float32
    with torch.autocast("cuda", dtype=torch.bfloat16):           # mixed dtypes: autocast's F.linear casts them
        assert not routed(x, w.float())[0]
    assert not routed(x[:, :1000], w[:, :1000])[0]               # K not a multiple of 64
    assert not routed(x, w[:1000])[0]                            # N not a multiple of 64
    _, wide = operands(1, 1024, 2048, torch.bfloat16, "cuda")   # [2048, 1024]: N > K
    assert not routed(x[:, :1024].contiguous(), wide)[0]
    w.requires_grad_(True)
    assert not routed(x, w)[0]                                   # a gradient is wanted
    with torch.no_grad():
        assert routed(x, w)[0]
    w.requires_grad_(False)
    monkeypatch.setenv("FW_SKINNY_LINEAR", "all")                # wherever the kernel fits
    assert routed(x[:, :1024].contiguous(), wide)[0] and routed(torch.cat([x] * 4), w)[0]
    monkeypatch.setenv("FW_SKINNY_LINEAR", "0")                  # the benchmarks' cuBLAS baseline
    assert not routed(x, w)[0]

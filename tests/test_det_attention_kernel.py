"""The deterministic-attention Pallas kernels (`pallas_kernels.det_attention`), interpret mode.

Both paths: TPU (Mosaic, scalar-prefetched page table) in Pallas' TPU interpret mode, GPU
(Triton) in the generic interpreter, against the jnp path they follow:
`block_attention.attend` with `Numerics("deterministic")` (and `attention.attend_paged`).

Case: H = 4 query heads over Hkv = 2 KV heads (G = 2), D = 128, page P = 16, scale
128^-0.5. A packed training row of B = 2: row 0 holds three sequences (10, 21 and 7 tokens)
starting at page boundaries 0, 16, 48 (segments 1, 2, 3; the gaps are padding tokens of
segment 0; keys past the row's T = 55 tokens are segment -1, as the transformer pads
them), row 1 one causal sequence without segments' help (all segment 4). q drawn with std 2
(sharp softmax rows), k and v standard normal.

What is compared, and what was measured:

* Against the jnp path, in interpret mode with the default dot operands (f32 holding the
  inputs' values, the jnp path's own dot operands): bitwise equal, bf16 and f32 inputs,
  training (with and without segments) and paged (scrambled pages, a null page, padding
  queries, multi-token prefill). For the GPU path this includes its 16-row dots against
  the jnp path's 8-row ones: XLA:CPU's f32 dot gives each row the same sums at 8 and 16
  rows here (measured; a statement about this CPU's dot kernel, not a guarantee).
  With bf16 inputs the outputs are rounded to bf16, which hides last-bit differences of
  the f32 result: the f32 case is the sharp check (a jnp.sum in place of the lane tree sum
  fails it, and passes the bf16 one).
* bf16 dot operands (what the kernels use compiled, on the MXU / tensor cores) in
  interpret mode: XLA:CPU's bf16 dot sums in another order, so scores differ from the
  jnp path's in the last f32 bits; the kernel is still batch invariant (bitwise) and within
  |out - ref| <= 2^-8 max|v| + 2^-7 |ref|: a score change of a few f32 ulps can flip the
  bf16 rounding of p (one bf16 ulp, 2^-8 relative, of each p; the output is a convex
  combination of v's rows, so at most 2^-8 max|v| in exact arithmetic), plus both outputs
  rounded to bf16 (2^-8 relative each). Measured: 0.005% of outputs one bf16 ulp apart
  (max 2^-9), 0.10 of the bound, both paths.
* Batch invariance (bitwise, each backend, both dot dtypes): a token's output alone (its
  sequence as the only row), in the packed row, as a one-token decode query over
  scrambled pages among companions of other lengths, with pages past its last visible
  block full of NaN (never read: a skipped block), and through the decode kernel vs the
  training kernel.

Lowering at Qwen3-30B-A3B attention shapes (H = 32, Hkv = 4, D = 128, page 16; a
4096-token packed row with segments for training, 64 sequences x 4096 tokens for
decode, bf16): the Mosaic lowering (a `tpu_custom_call`; its body decoded and checked:
grid, two scalar-prefetch operands, the K block's index map reading the page table from
SMEM, `tpu.matmul`) and the Triton lowering (`__gpu$xla.gpu.triton`) both run on this
CPU-only jaxlib. libtpu's compiler (Mosaic) compiles both TPU kernels for one v5p chip from
this CPU (tests/mosaic.py), also as the model calls them: the decode step over all layers'
raw-bit pools, the training forward with its backward. Neither path is run on a device here.
"""

import functools
import re

from rljax.numerics import Numerics

DET = Numerics("deterministic")  # installs the XLA flags before any JAX computation

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from pallas_kernels import det_attention as det_attention_lib  # noqa: E402
from pallas_kernels.det_attention import det_attention, det_paged_attention  # noqa: E402
from rljax import block_attention  # noqa: E402
from rljax.block_attention import attend  # noqa: E402
from rljax.model.attention import (attend_det_kernel, attend_paged,  # noqa: E402
                                  attend_paged_det_kernel, raw_dtype)
from tests.mosaic import compile_for_tpu, mosaic_body  # noqa: E402

H, HKV, D, P = 4, 2, 128, 16
SCALE = D ** -0.5
LENGTHS = (10, 21, 7)
STARTS = (0, 16, 48)
T, N = 55, 64
DTYPES = {"bf16": jnp.bfloat16, "f32": jnp.float32}
BACKENDS = ("tpu", "gpu")


def _bits(x) -> np.ndarray:
  return np.asarray(jnp.asarray(x).astype(jnp.float32))


@functools.lru_cache(maxsize=None)
def _seqs(dtype_name: str):
  """Per sequence (q [L, H, D], k, v [L, Hkv, D]) as f32 numpy holding dtype values;
  sequence 3 (40 tokens) is row 1."""
  rng = np.random.default_rng(0)
  dtype = DTYPES[dtype_name]
  out = []
  for n in LENGTHS + (40,):
    q = rng.standard_normal((n, H, D)) * 2.0
    k, v = rng.standard_normal((2, n, HKV, D))
    out.append(tuple(_bits(jnp.asarray(x, dtype)) for x in (q, k, v)))
  return out


@functools.lru_cache(maxsize=None)
def _row(dtype_name: str):
  """The packed training batch: q [2, T, H, D], k, v [2, N, Hkv, D], q_index [2, T],
  q_segments [2, T], kv_segments [2, N]."""
  seqs = _seqs(dtype_name)
  q = np.zeros((2, T, H, D), np.float32)
  k = np.zeros((2, N, HKV, D), np.float32)
  v = np.zeros_like(k)
  qs = np.zeros((2, T), np.int32)
  ks = np.full((2, N), -1, np.int32)
  ks[:, :T] = 0
  places = [(0, s) for s in STARTS] + [(1, 0)]
  for i, ((sq, sk, sv), (row, start)) in enumerate(zip(seqs, places)):
    n = len(sq)
    q[row, start:start + n], k[row, start:start + n], v[row, start:start + n] = sq, sk, sv
    qs[row, start:start + n] = ks[row, start:start + n] = i + 1
  dtype = DTYPES[dtype_name]
  q_index = np.broadcast_to(np.arange(T, dtype=np.int32), (2, T))
  return (jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype),
          jnp.asarray(q_index), jnp.asarray(qs), jnp.asarray(ks))


def _train(backend, q, k, v, q_index, qs=None, ks=None, **kw):
  return det_attention(q, k, v, q_index, q_segments=qs, kv_segments=ks, page_size=P,
                       scale=SCALE, backend=backend, interpret=True, **kw)


def _paged(backend, *args, **kw):
  return det_paged_attention(*args, scale=SCALE, backend=backend, interpret=True, **kw)


@functools.lru_cache(maxsize=None)
def _pool(dtype_name: str, extra_blocks: int, nan_unused: bool):
  """Every sequence's pages scrambled over one pool with a null page 0; a row per sequence,
  its table extended by `extra_blocks` entries (null page, and past sequence ends: pages
  of NaN when nan_unused, else zeros). -> (k_pool, v_pool, table [4, NB])."""
  seqs = _seqs(dtype_name)
  rng = np.random.default_rng(1)
  blocks = [-(-len(s[0]) // P) for s in seqs]
  nb = max(blocks) + extra_blocks
  num_pages = 1 + sum(blocks) + 2
  junk = np.nan if nan_unused else 0.0
  k = np.full((num_pages, P, HKV, D), junk, np.float32)
  v = np.full_like(k, junk)
  order = 1 + rng.permutation(num_pages - 1)
  table = np.zeros((len(seqs), nb), np.int32)
  spare = [int(x) for x in order[sum(blocks):]]  # pages no sequence owns
  used = 0
  for i, (_, sk, sv) in enumerate(seqs):
    n = len(sk)
    for j in range(blocks[i]):
      page = int(order[used])
      used += 1
      table[i, j] = page
      lo, hi = j * P, min((j + 1) * P, n)
      k[page] = v[page] = 0.0  # lanes past the sequence's end are finite (never visible)
      k[page, :hi - lo], v[page, :hi - lo] = sk[lo:hi], sv[lo:hi]
    table[i, blocks[i]:] = spare[i % len(spare)] if i % 2 else 0
  dtype = DTYPES[dtype_name]
  return jnp.asarray(k, dtype), jnp.asarray(v, dtype), jnp.asarray(table)


# ------------------------------------------------------------------ against the jnp path


def test_row_tile_is_the_jnp_paths():
  assert det_attention_lib.ROW_TILE == block_attention.ROW_TILE == 8
  assert det_attention_lib.row_tile("tpu") == 8 and det_attention_lib.row_tile("gpu") == 16


@pytest.mark.parametrize("dtype_name", ["bf16", "f32"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_training_kernel_bitwise_equals_attend(backend, dtype_name):
  q, k, v, q_index, qs, ks = _row(dtype_name)
  ref = attend(q, k, v, q_index, page_size=P, numerics=DET, scale=SCALE, q_segments=qs,
               kv_segments=ks)
  out = _train(backend, q, k, v, q_index, qs, ks)
  assert out.shape == q.shape and out.dtype == q.dtype
  np.testing.assert_array_equal(_bits(out), _bits(ref))
  if dtype_name == "bf16":  # no segments: causal over the whole row
    ref = attend(q, k, v, q_index, page_size=P, numerics=DET, scale=SCALE)
    np.testing.assert_array_equal(_bits(_train(backend, q, k, v, q_index)), _bits(ref))


@pytest.mark.parametrize("backend", BACKENDS)
def test_paged_kernel_bitwise_equals_attend_paged(backend):
  """Multi-token queries (a prefill chunk, decode steps, padding -1) over scrambled pages;
  the engine's raw-bits pools (with dtype) give the same bits."""
  k_pool, v_pool, table = _pool("bf16", 2, False)
  seqs = _seqs("bf16")
  positions = np.array([[7, 8, 9], [18, 19, 20], [-1, -1, -1], [37, 38, 39]], np.int32)
  q = np.zeros((4, 3, H, D), np.float32)
  for i in range(4):
    for t, p in enumerate(positions[i]):
      if p >= 0:
        q[i, t] = seqs[i][0][p]
  q, positions = jnp.asarray(q, jnp.bfloat16), jnp.asarray(positions)
  ref = attend_paged(q, k_pool, v_pool, table, positions, dtype=jnp.bfloat16, numerics=DET,
                     scale=SCALE)
  out = _paged(backend, q, k_pool, v_pool, table, positions)
  assert out.shape == q.shape and out.dtype == q.dtype
  np.testing.assert_array_equal(_bits(out), _bits(ref))
  raw = jnp.dtype(raw_dtype(jnp.bfloat16))
  k_raw, v_raw = (jax.lax.bitcast_convert_type(x, raw) for x in (k_pool, v_pool))
  out_raw = _paged(backend, q, k_raw, v_raw, table, positions, dtype=jnp.bfloat16)
  np.testing.assert_array_equal(_bits(out_raw), _bits(ref))


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_dot_operands_within_bound(backend):
  """dot_dtype=bf16 (the compiled default) in interpret mode: XLA:CPU's bf16 dot, another
  summation order; held to the module docstring's bound."""
  q, k, v, q_index, qs, ks = _row("bf16")
  ref = _bits(attend(q, k, v, q_index, page_size=P, numerics=DET, scale=SCALE,
                     q_segments=qs, kv_segments=ks))
  out = _bits(_train(backend, q, k, v, q_index, qs, ks, dot_dtype=jnp.bfloat16))
  vmax = float(jnp.max(jnp.abs(v.astype(jnp.float32))))
  np.testing.assert_array_less(np.abs(out - ref), 2**-8 * vmax + 2**-7 * np.abs(ref) + 1e-30)


# ---------------------------------------------------------------------- batch invariance


@pytest.mark.parametrize("dot_dtype", [None, jnp.bfloat16], ids=["f32_dots", "bf16_dots"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_batch_invariance_bitwise(backend, dot_dtype):
  """Sequence 2 (21 tokens; row 0 at 16..36 of the packed row): its tokens' outputs alone,
  packed, and as one-token decode queries over scrambled pages (companions of other
  lengths, a padding row, 3 extra table entries of NaN pages past each row's end) are
  the same bits; so are the decode kernel's and the training kernel's for a prefill chunk.
  """
  kw = dict(dot_dtype=dot_dtype)
  q, k, v, q_index, qs, ks = _row("bf16")
  packed = _bits(_train(backend, q, k, v, q_index, qs, ks, **kw))[0, 16:37]
  sq, sk, sv = (jnp.asarray(x, jnp.bfloat16) for x in _seqs("bf16")[1])
  pad = ((0, 32 - 21), (0, 0), (0, 0))
  alone = _train(backend, sq[None], jnp.pad(sk, pad)[None], jnp.pad(sv, pad)[None],
                 jnp.arange(21, dtype=jnp.int32)[None], **kw)
  np.testing.assert_array_equal(_bits(alone)[0], packed)
  # one-token decode of token 19 (second page) and token 4, in a batch of 4 rows
  k_pool, v_pool, table = _pool("bf16", 3, True)
  seqs = _seqs("bf16")
  for p in (19, 4):
    positions = jnp.asarray([[5], [p], [-1], [33]], jnp.int32)
    qd = jnp.asarray(np.stack([seqs[0][0][5], seqs[1][0][p], seqs[2][0][0],
                               seqs[3][0][33]])[:, None], jnp.bfloat16)
    dec = _bits(_paged(backend, qd, k_pool, v_pool, table, positions, **kw))
    assert np.all(np.isfinite(dec))  # no NaN page was used
    np.testing.assert_array_equal(dec[1, 0], packed[p])
    np.testing.assert_array_equal(dec[2, 0], 0.0)  # padding query: sees nothing
  # decode kernel vs training kernel: a prefill chunk of tokens 12..19 of sequence 2
  chunk = _paged(backend, sq[None, 12:20], k_pool, v_pool, table[1:2],
                 jnp.arange(12, 20, dtype=jnp.int32)[None], **kw)
  np.testing.assert_array_equal(_bits(chunk)[0], packed[12:20])


# ----------------------------------------------------------------------------- lowering


QWEN_TRAIN = (jax.ShapeDtypeStruct((1, 4096, 32, 128), jnp.bfloat16),
              jax.ShapeDtypeStruct((1, 4096, 4, 128), jnp.bfloat16),
              jax.ShapeDtypeStruct((1, 4096, 4, 128), jnp.bfloat16),
              jax.ShapeDtypeStruct((1, 4096), jnp.int32),
              jax.ShapeDtypeStruct((1, 4096), jnp.int32),
              jax.ShapeDtypeStruct((1, 4096), jnp.int32))
QWEN_PAGES = 64 * 256 + 1
QWEN_DECODE = (jax.ShapeDtypeStruct((64, 1, 32, 128), jnp.bfloat16),
               jax.ShapeDtypeStruct((QWEN_PAGES, 16, 4, 128), jnp.bfloat16),
               jax.ShapeDtypeStruct((QWEN_PAGES, 16, 4, 128), jnp.bfloat16),
               jax.ShapeDtypeStruct((64, 256), jnp.int32),
               jax.ShapeDtypeStruct((64, 1), jnp.int32))


def _kernel_call(platform: str, which: str, **kw):
  """(kernel function, its Qwen3-30B-A3B-shaped args) for `platform`."""
  backend = "tpu" if platform == "tpu" else "gpu"
  if which == "train":
    def fn(q, k, v, qi, qs, ks):
      return det_attention(q, k, v, qi, q_segments=qs, kv_segments=ks, page_size=16,
                           scale=128 ** -0.5, backend=backend, **kw)
    return fn, QWEN_TRAIN
  return functools.partial(det_paged_attention, scale=128 ** -0.5, backend=backend,
                           **kw), QWEN_DECODE


def _lower(platform: str, which: str, **kw) -> str:
  fn, args = _kernel_call(platform, which, **kw)
  return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()


@pytest.mark.parametrize("which,grid,smem,pages", [
    # B x Hkv x 1 tile (G = 8 rows) x NB; SMEM: the page table, 64 x 256
    ("decode", "64, 4, 1, 256", "memref<16384xi32", QWEN_PAGES),
    # 4096 queries x 8 rows = 4096 tiles; the row's 256 blocks as an identity page table
    ("train", "1, 4, 4096, 256", "memref<256xi32", 256)])
def test_lowers_for_tpu_at_qwen3_shapes(which, grid, smem, pages):
  text = _lower("tpu", which)
  assert "tpu_custom_call" in text and 'kernel_name = "det_attention_tpu"' in text
  assert f"tensor<{pages}x16x512xbf16>" in text  # the pool's free [pages, P, Hkv * D] view
  body = mosaic_body(text)
  assert f"iteration_bounds = array<i64: {grid}>" in body
  assert "scalar_prefetch = 2" in body and f"{smem}, #tpu.memory_space<smem>>" in body
  assert "window_bounds = array<i64: 1, 16, 128>" in body  # one head's [P, D] of a page
  k_map = re.search(r"\^bb0.*?sym_name = \"transform_1\"", body.split("transform_0")[-1],
                    re.S).group(0)
  assert k_map.count("memref.load") == 2  # tile_last, then the page id, from SMEM
  assert "tpu.matmul" in body and "vector<8x128xbf16>, vector<16x128xbf16>" in body
  # f32 dot operands (the interpret-mode default) lower too
  assert "tpu_custom_call" in _lower("tpu", which, dot_dtype=jnp.float32)


@pytest.mark.parametrize("which", ["train", "decode"])
def test_compiles_for_tpu_at_qwen3_shapes(which):
  """Mosaic compiles both kernels (their block shapes are legal), for one chip."""
  fn, args = _kernel_call("tpu", which)
  assert "det_attention_tpu" in compile_for_tpu(fn, *args).as_text()


def test_the_models_decode_call_compiles_for_tpu_at_qwen3_shapes():
  """`attend_paged_det_kernel` as a decode step calls it: one layer (traced index) of all
  48 layers' pools, kept as raw bits, read by the kernel."""
  q, k_pool, _, table, positions = QWEN_DECODE
  pools = jax.ShapeDtypeStruct((48, *k_pool.shape), raw_dtype(jnp.bfloat16))

  def step(q, k_pool, v_pool, table, positions, layer):
    return attend_paged_det_kernel(q, k_pool, v_pool, table, positions, layer=layer,
                                   dtype=jnp.bfloat16, scale=128 ** -0.5, kernel="pallas_tpu")

  compiled = compile_for_tpu(step, q, pools, pools, table, positions,
                             jax.ShapeDtypeStruct((), jnp.int32))
  assert "det_attention_tpu" in compiled.as_text()


def test_the_training_call_and_its_backward_compile_for_tpu():
  """`attend_det_kernel` as the training forward calls it, with its backward (the fast
  path's VJP), at Qwen3-30B-A3B's heads on a 512-token packed row (the kernel's blocks are
  the 4096-token row's; a shorter row keeps the compile of the backward to seconds)."""
  t = 512
  q, k, v, q_index, q_segments, kv_segments = (
      jax.ShapeDtypeStruct((a.shape[0], t, *a.shape[2:]), a.dtype) for a in QWEN_TRAIN)

  def loss(q, k, v, q_index, q_segments, kv_segments):
    out = attend_det_kernel(q, k, v, q_index, q_segments, kv_segments, 16, 128 ** -0.5,
                            "pallas_tpu")
    return jnp.sum(out.astype(jnp.float32))

  compiled = compile_for_tpu(jax.value_and_grad(loss, argnums=(0, 1, 2)), q, k, v, q_index,
                             q_segments, kv_segments)
  assert "det_attention_tpu" in compiled.as_text()


@pytest.mark.parametrize("which,grid", [("decode", (64, 4, 1)), ("train", (1, 4, 2048))])
def test_lowers_for_triton_at_qwen3_shapes(which, grid):
  """Triton IR is produced (not compiled or run: no GPU here); 16-row tiles."""
  text = _lower("cuda", which)
  assert "__gpu$xla.gpu.triton" in text and 'name = "det_attention_gpu"' in text
  for axis, n in zip("xyz", grid):
    assert f"grid_{axis} = {n} : i32" in text


# ---------------------------------------------------------------------------- bad input


def test_bad_inputs_raise_clear_errors():
  q, k, v, q_index, qs, ks = _row("f32")
  k3 = jnp.concatenate([k, k[:, :, :1]], axis=2)
  train = dict(q=q, k=k, v=v, q_index=q_index, page_size=P, scale=SCALE, backend="tpu")
  cases = [
      (dict(backend="cpu"), "backend must be one of"),
      (dict(q=q[0]), r"q must be \[B, T, H, D\]"),
      (dict(k=k[:, :, :1]), r"k .* and v .* must both be \[B, N, Hkv, D\]"),
      (dict(k=k[..., :64], v=v[..., :64]), "disagree on head_dim"),
      (dict(k=k3, v=k3), "query heads 4 are not a multiple of kv heads 3"),
      (dict(q=q.astype(jnp.float16)), "q dtype must be bfloat16 or float32"),
      (dict(v=v.astype(jnp.bfloat16)), "k and v dtypes differ"),
      (dict(page_size=12), "page_size=12 must be a power of two"),
      (dict(page_size=128), "key count 64 is not a positive multiple of page_size 128"),
      (dict(page_size=4), "tpu: page_size=4 must be a multiple of 8"),
      (dict(backend="gpu", page_size=8), r"gpu: page_size=8 must be a power of two >= 16"),
      (dict(q_index=q_index[:, :5]), r"q_index must be integer \[2, 55\]"),
      (dict(q_index=q_index.astype(jnp.float32)), "q_index must be integer"),
      (dict(q_segments=qs), "pass both q_segments and kv_segments"),
      (dict(q_segments=qs, kv_segments=ks[:, :10]), r"kv_segments must be integer \[2, 64\]"),
      (dict(dot_dtype=jnp.float16), "dot_dtype must be bfloat16 or float32"),
      (dict(q=q[..., :64], k=k[..., :64], v=v[..., :64]),
       "tpu: head_dim D=64 must be a multiple of 128"),
  ]
  for change, message in cases:
    with pytest.raises(ValueError, match=message):
      det_attention(**{**train, **change})
  k_pool, v_pool, table = _pool("f32", 0, False)
  positions = jnp.zeros((4, 1), jnp.int32)
  qd = q[:1, :1].repeat(4, 0)
  paged = dict(q=qd, k_pool=k_pool, v_pool=v_pool, page_table=table, positions=positions,
               scale=SCALE, backend="gpu")
  raw = jax.lax.bitcast_convert_type(k_pool, jnp.uint32)
  cases = [
      (dict(k_pool=k_pool[0]), r"must both be \[num_pages, P, Hkv, D\]"),
      (dict(page_table=table[:2]), r"page_table must be integer \[B, NB\] = \[4"),
      (dict(page_table=table.astype(jnp.float32)), "page_table must be integer"),
      (dict(positions=positions[:, 0]), r"positions must be integer \[4, 1\]"),
      (dict(k_pool=raw, v_pool=raw), r"pools of raw bits \(uint32\) need `dtype`"),
  ]
  for change, message in cases:
    with pytest.raises(ValueError, match=message):
      det_paged_attention(**{**paged, **change})

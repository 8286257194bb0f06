"""The Tinker SDK's protobuf messages (its own schema, `tinker.proto.tinker_public_pb2`) to
and from `rljax.tinker.training`'s arrays."""

from __future__ import annotations

import numpy as np
from tinker.proto import tinker_public_pb2 as pb

from rljax.tinker.training import Datum, UserError

_DTYPES = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}


def tensor(t: "pb.Tensor", name: str) -> np.ndarray:
  """A dense numpy array of a Tensor (dense bytes, or CSR densified with zeros)."""
  if t.dtype not in _DTYPES:
    raise UserError(f"loss_fn_inputs[{name!r}]: dtype {pb.DType.Name(t.dtype)} is not "
                    "supported (float32, int64, int32)")
  dtype = _DTYPES[t.dtype]
  shape = tuple(t.shape)
  if t.WhichOneof("encoding") == "sparse_csr":
    if len(shape) != 2:
      raise UserError(f"loss_fn_inputs[{name!r}]: a sparse tensor needs a 2-D shape")
    values = np.frombuffer(t.sparse_csr.values, dtype)
    crow = np.frombuffer(t.sparse_csr.crow_indices, np.int64)
    cols = np.frombuffer(t.sparse_csr.col_indices, np.int64)
    if len(crow) != shape[0] + 1 or len(cols) != len(values) or (
        len(cols) and (cols.min() < 0 or cols.max() >= shape[1])):
      raise UserError(f"loss_fn_inputs[{name!r}]: malformed sparse tensor")
    out = np.zeros(shape, dtype)
    rows = np.repeat(np.arange(shape[0]), np.diff(crow))
    out[rows, cols] = values
    return out
  data = t.dense
  if len(data) % np.dtype(dtype).itemsize:
    raise UserError(f"loss_fn_inputs[{name!r}]: {len(data)} bytes is not a whole number "
                    f"of {np.dtype(dtype).name}")
  arr = np.frombuffer(data, dtype)
  if shape:
    if int(np.prod(shape)) != arr.size:
      raise UserError(f"loss_fn_inputs[{name!r}]: shape {list(shape)} does not hold "
                      f"{arr.size} values")
    arr = arr.reshape(shape)
  return arr


def datum(d: "pb.Datum", index: int) -> Datum:
  tokens = []
  for chunk in d.model_input:
    kind = chunk.WhichOneof("chunk")
    if kind != "encoded_text":
      raise UserError(f"datum {index}: {kind} chunks are not supported (text models only)")
    if len(chunk.encoded_text.tokens) % 4:
      raise UserError(f"datum {index}: encoded_text tokens are not int32")
    tokens.append(np.frombuffer(chunk.encoded_text.tokens, np.int32))
  inputs = {}
  for name, t in d.loss_fn_inputs.items():
    arr = tensor(t, name)
    if arr.ndim != 1:
      raise UserError(f"datum {index}: loss_fn_inputs[{name!r}] must be 1-D per datum, got "
                      f"shape {list(arr.shape)}")
    inputs[name] = arr
  return Datum(np.concatenate(tokens).astype(np.int32) if tokens else np.zeros(0, np.int32),
               inputs)


def loss_config(req: "pb.ForwardBackwardRequest") -> dict[str, float]:
  """loss_fn_config_v2 (number values) when sent, else the legacy float map."""
  if req.loss_fn_config_v2:
    out = {}
    for k, v in req.loss_fn_config_v2.items():
      if v.WhichOneof("value") != "number":
        raise UserError(f"loss_fn_config[{k!r}] must be a number")
      out[k] = v.number
    return out
  return dict(req.loss_fn_config)


def forward_backward_output(logprobs: list[np.ndarray], metrics: dict[str, float]) -> bytes:
  """A ForwardBackwardOutput: one ArrayRecord whose `logprobs` field holds each datum's
  per-token log-probs (float32, int64 byte offsets)."""
  out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
  record = out.loss_fn_outputs.add()
  record.num_datums = len(logprobs)
  field = record.fields["logprobs"]
  field.dtype = pb.DTYPE_FLOAT32
  arrays = [np.ascontiguousarray(lp, np.float32) for lp in logprobs]
  offsets = np.zeros(len(arrays) + 1, np.int64)
  np.cumsum([a.nbytes for a in arrays], out=offsets[1:])
  field.offsets = offsets.tobytes()
  field.data = b"".join(a.tobytes() for a in arrays)
  for k, v in metrics.items():
    out.metrics[k] = v
  return out.SerializeToString()


def forward_backward_request(body: bytes) -> "pb.ForwardBackwardRequest":
  req = pb.ForwardBackwardRequest()
  try:
    req.ParseFromString(body)
  except Exception as e:  # pylint: disable=broad-except  (protobuf's DecodeError)
    raise UserError(f"forward_backward: the body is not a ForwardBackwardRequest ({e})")
  return req

"""The Tinker API's protobuf messages, read and written with the schema the ``tinker`` client
ships (``tinker.proto.tinker_public_pb2``): what `forward_backward` posts, and the two results
the client takes only as protobuf (`ForwardBackwardOutput`, `SampleResponse`). Everything else
the API speaks is JSON, validated with the client's own pydantic types (rlvr.tinker.app).

Tensors on the wire are flat little-endian buffers: tokens int32, loss inputs float32 or int64,
dense or sparse CSR (a row-pointer and a column-index buffer beside the values).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rlvr.log.tracking import import_extra

INSTALL_HINT = "pip install 'rlvr[tinker]'"


class Invalid(ValueError):
    """A request the service refuses as malformed (an HTTP 400 that says what and where)."""


def schema() -> Any:
    """The client package's protobuf module."""
    import_extra("tinker", f"rlvr tinker speaks the tinker client's wire format, from its package: {INSTALL_HINT}")
    from tinker.proto import tinker_public_pb2

    return tinker_public_pb2


@dataclass
class Datum:
    """One training example: the input tokens, and the loss's inputs, each aligned with them
    (position i of ``tokens`` predicts ``inputs["target_tokens"][i]``)."""

    tokens: list[int]
    inputs: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass
class ForwardBackward:
    model_id: str
    seq_id: int
    loss_fn: str
    config: dict[str, float | str]
    forward_only: bool
    data: list[Datum]


def _dtype(pb: Any, code: int, where: str) -> np.dtype:
    known: dict[int, np.dtype] = {pb.DTYPE_FLOAT32: np.dtype("<f4"), pb.DTYPE_INT64: np.dtype("<i8"), pb.DTYPE_INT32: np.dtype("<i4")}
    if code not in known:
        raise Invalid(f"{where}: tensor dtype {code} is not one of float32, int64, int32")
    return known[code]


def _buffer(data: bytes, dtype: np.dtype, where: str) -> np.ndarray:
    if len(data) % dtype.itemsize:
        raise Invalid(f"{where}: {len(data)} bytes is not a whole number of {dtype.name} values")
    return np.frombuffer(data, dtype=dtype)


def tensor(pb: Any, msg: Any, where: str) -> np.ndarray:
    """A proto ``Tensor`` as a dense array of its shape (a sparse CSR one filled in with zeros)."""
    dtype = _dtype(pb, msg.dtype, where)
    shape = [int(s) for s in msg.shape]
    if any(s < 0 for s in shape):
        raise Invalid(f"{where}: negative shape {shape}")
    if msg.HasField("sparse_csr"):
        if len(shape) != 2:
            raise Invalid(f"{where}: a sparse tensor must be 2-D, got shape {shape}")
        csr = msg.sparse_csr
        values = _buffer(csr.values, dtype, where)
        crow = _buffer(csr.crow_indices, np.dtype("<i8"), where)
        col = _buffer(csr.col_indices, np.dtype("<i8"), where)
        rows, cols = shape
        if len(crow) != rows + 1 or len(col) != len(values) or (len(crow) and (crow[0] != 0 or crow[-1] != len(values))) \
                or np.any(np.diff(crow) < 0) or np.any((col < 0) | (col >= cols)):
            raise Invalid(f"{where}: the sparse CSR indices do not describe a {rows}×{cols} tensor")
        dense = np.zeros(shape, dtype=dtype)
        for r in range(rows):
            dense[r, col[crow[r]:crow[r + 1]]] = values[crow[r]:crow[r + 1]]
        return dense
    flat = _buffer(msg.dense, dtype, where)
    if not shape:
        shape = [len(flat)]
    if int(np.prod(shape)) != len(flat):
        raise Invalid(f"{where}: shape {shape} does not hold {len(flat)} values")
    return flat.reshape(shape).copy()


def parse_forward_backward(body: bytes, content_encoding: str | None = None) -> ForwardBackward:
    """The posted `ForwardBackwardRequest` (zstd-compressed where the client says so)."""
    pb = schema()
    if content_encoding == "zstd":
        import zstandard

        try:
            body = zstandard.ZstdDecompressor().decompress(body, max_output_size=1 << 31)
        except zstandard.ZstdError as e:
            raise Invalid(f"the body says Content-Encoding: zstd but does not decompress: {e}") from None
    elif content_encoding not in (None, "", "identity"):
        raise Invalid(f"Content-Encoding {content_encoding!r} is not supported (send zstd or none)")
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as e:  # noqa: BLE001 - protobuf's DecodeError, whatever its module
        raise Invalid(f"the body is not a ForwardBackwardRequest protobuf message: {e}") from None
    config: dict[str, float | str] = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for k, v in msg.loss_fn_config_v2.items():
        config[k] = v.text if v.WhichOneof("value") == "text" else float(v.number)
    data = []
    for i, d in enumerate(msg.data):
        tokens: list[int] = []
        for j, chunk in enumerate(d.model_input):
            kind = chunk.WhichOneof("chunk")
            if kind != "encoded_text":
                raise Invalid(f"data[{i}].model_input[{j}] is a {kind or 'empty'} chunk: rlvr tinker takes token "
                              "chunks only (images and audio are not supported)")
            tokens += _buffer(chunk.encoded_text.tokens, np.dtype("<i4"), f"data[{i}].model_input[{j}]").tolist()
        # provenance spans (which sampled sequence each token came from) serve stable_reinforce only,
        # which is refused; every other loss reads the tensors alone, so the spans are not read
        inputs = {name: tensor(pb, t, f"data[{i}].loss_fn_inputs[{name!r}]") for name, t in d.loss_fn_inputs.items()}
        data.append(Datum(tokens, inputs))
    return ForwardBackward(msg.model_id, int(msg.seq_id), msg.loss_fn, config, bool(msg.forward_only), data)


def forward_backward_output(outputs: list[dict[str, np.ndarray]], metrics: dict[str, float]) -> bytes:
    """A `ForwardBackwardOutput`: each datum's output arrays (1-D float32, e.g. ``logprobs``),
    batched field by field, and the metrics (``name:reduction`` keys, as the client folds them)."""
    pb = schema()
    msg = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    for k, v in metrics.items():
        msg.metrics[k] = float(v)
    record = msg.loss_fn_outputs.add()
    record.num_datums = len(outputs)
    for name in outputs[0] if outputs else []:
        arrays = [np.ascontiguousarray(o[name], dtype="<f4").reshape(-1) for o in outputs]
        offsets = np.concatenate([[0], np.cumsum([a.nbytes for a in arrays])]).astype("<i8")
        batched = record.fields[name]
        batched.dtype = pb.DTYPE_FLOAT32
        batched.data = b"".join(a.tobytes() for a in arrays)
        batched.offsets = offsets.tobytes()
    return bytes(msg.SerializeToString())


@dataclass
class Sequence:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: str
    """"stop" or "length"."""


def sample_response(sequences: list[Sequence], prompt_logprobs: list[float | None] | None = None) -> bytes:
    """A `SampleResponse`; a prompt position without a log-prob (the first) goes as NaN, which the
    client reads as None."""
    pb = schema()
    msg = pb.SampleResponse()
    for s in sequences:
        seq = msg.sequences.add()
        seq.stop_reason = pb.STOP_REASON_STOP if s.stop_reason == "stop" else pb.STOP_REASON_LENGTH
        seq.tokens = np.asarray(s.tokens, dtype="<i4").tobytes()
        seq.logprobs = np.asarray(s.logprobs, dtype="<f4").tobytes()
    if prompt_logprobs is not None:
        msg.prompt_logprobs = np.asarray([np.nan if v is None else v for v in prompt_logprobs], dtype="<f4").tobytes()
    return bytes(msg.SerializeToString())

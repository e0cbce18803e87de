"""Static INT8 on the torch side: neural-compressor's PT2E quantization, tuned by its own `autotune`,
exported to a QDQ ONNX graph by the dynamo exporter so that it competes with the ORT variants.

The flow: the serving graph (pre- and post-processing included) is captured with
`neural_compressor.torch.export.export` (torch.export with dynamic batch and sequence axes);
`autotune` tries the configurations of one optiserve trial in order, each calibrated on the
recipe's calibration rows, and keeps the first whose outputs agree with the FP32 module on those
rows within its tolerance (else its best); the quantized module goes through
`torch.onnx.export(..., dynamo=True)`. The exporter leaves weights as float → QuantizeLinear →
DequantizeLinear → Transpose; folding them into int8 initializers that feed DequantizeLinear
directly is what lets ONNX Runtime pick its integer kernels. The optiserve tuner still makes the
final call on held-out data; what autotune tried is written into the trial's config.
"""

from __future__ import annotations

import copy
import logging
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
from onnx import numpy_helper

from pipeline.export import ServingGraph, export_onnx
from pipeline.variants.base import VariantInputs, kind
from serving.cpu import has_vnni

logger = logging.getLogger(__name__)

INC_KIND = "inc-int8"
CALIBRATION_BATCH = 16  # rows per batch: autotune calibrates and scores on the same batches
DYNAMO_MIN_OPSET = 18  # the dynamo exporter's own opset; converting down fails on QDQ graphs
QUANTIZABLE = (torch.ops.aten.linear.default, torch.ops.aten.conv2d.default, torch.ops.aten.conv1d.default)


def _configs(inputs: VariantInputs) -> list[dict[str, Any]]:
    """Fastest first: every linear/conv in int8, then the first and last of them kept in float.

    Within each, autotune tries min-max calibration before KL (histogram) calibration. Activations
    are asymmetric uint8 per tensor and weights symmetric int8 per channel: the x86 fast path.
    Convolution weights get 7 bits on CPUs without VNNI (see `fold_weight_quantization`); linear
    weights keep 8, measured to lose nothing to saturation in ORT's integer MatMul here.
    `autotune` starts empty and the build fills it in place with what neural-compressor tried; the
    tuner's trial record holds the same dict, so the record shows it.
    """
    conv_weight_bits = 8 if has_vnni() else 7
    return [
        {
            "layers": layers,
            "act_algos": ["minmax", "kl"],
            "tolerable_loss": 0.01,
            "conv_weight_bits": conv_weight_bits,
            "autotune": {},
        }
        for layers in ("all", "all-but-ends")
    ]


@kind(INC_KIND, "int8", _configs)
def _inc_int8(inputs: VariantInputs, config: dict, out: Path) -> None:
    """neural-compressor PT2E static INT8 (autotuned on calibration data), exported as QDQ ONNX by the
    dynamo exporter."""
    graph = inputs.graph
    if graph is None:
        raise ValueError(f"{INC_KIND} needs the PyTorch serving graph and none was given")
    if not len(inputs.calibration):
        raise ValueError(f"{INC_KIND} needs calibration data and the calibration set is empty")
    batches = [_tensors(graph, feeds) for feeds in inputs.calibration_batches(CALIBRATION_BATCH)]
    dynamic = _dynamic_shapes(graph.dynamic_axes, graph.input_names)
    exported = _capture(graph.module, graph.example_inputs, dynamic)
    quantized, tuning = _autotune(exported, config, batches, _agreement(graph.module, batches))
    config.setdefault("autotune", {}).update(tuning)  # what autotune tried, for the trial record
    opset = max(inputs.opset, DYNAMO_MIN_OPSET)
    _export_onnx(quantized, graph, dynamic, out, opset=opset, conv_weight_bits=config.get("conv_weight_bits", 8))


def _tensors(graph: ServingGraph, feeds: dict[str, np.ndarray]) -> tuple[torch.Tensor, ...]:
    """The feeds the ONNX graphs get, as torch tensors in the serving graph's input order."""
    return tuple(torch.from_numpy(np.ascontiguousarray(feeds[name])) for name in graph.input_names)


def _dynamic_shapes(dynamic_axes: dict[str, dict[int, str]], input_names: list[str]) -> tuple[dict, ...]:
    """The FP32 export's dynamic input axes for torch.export. `Dim.DYNAMIC` lets torch.export infer the
    range (a BERT's sequence stops at its position table) and the equalities between inputs; the axis
    names are put back on the ONNX graph afterwards (`_name_dynamic_axes`)."""
    return tuple({axis: torch.export.Dim.DYNAMIC for axis in dynamic_axes.get(name, {})} for name in input_names)


def _capture(module: torch.nn.Module, example_inputs: tuple, dynamic: tuple) -> torch.fx.GraphModule:
    """PT2E capture; unused branches (BERT's pooler under mean pooling) are dropped, since the x86
    quantizer cannot annotate an operator whose output nobody reads."""
    from neural_compressor.torch.export import export

    module = copy.deepcopy(module).eval()  # the serving graph stays untouched for the other variants
    with _quiet() as log:
        try:
            exported = export(module, example_inputs, dynamic_shapes=dynamic)
        except Exception as exc:
            raise RuntimeError(f"{INC_KIND}: PT2E export (torch.export) failed: {log.reason(exc)}") from exc
    exported.graph.eliminate_dead_code()
    exported.recompile()
    return exported


Score = Callable[[torch.nn.Module], float]


def _agreement(reference: torch.nn.Module, batches: list[tuple]) -> Score:
    """How closely a module reproduces the FP32 serving graph on the calibration rows: the mean cosine
    of their outputs (embeddings, or class probabilities), 1.0 when identical. Continuous on purpose:
    top-1 agreement on a few ambiguous photos flips with noise and cannot rank configurations."""
    with torch.no_grad():
        expected = [reference(*batch) for batch in batches]

    def score(module: torch.nn.Module) -> float:
        with torch.no_grad():
            got = [module(*batch) for batch in batches]
        cosine = [torch.nn.functional.cosine_similarity(a, b, dim=-1) for a, b in zip(expected, got, strict=True)]
        return float(torch.cat(cosine).mean())

    return score


def _layer_names(exported: torch.fx.GraphModule) -> list[str]:
    """Module names of the quantizable layers (linear, conv) in execution order."""
    names = []
    for node in exported.graph.nodes:
        stack = node.meta.get("nn_module_stack") if node.target in QUANTIZABLE else None
        if stack:
            name = list(stack.values())[-1][0]
            names.append(name.removeprefix("L['self']."))
    return names


def _inc_configs(exported: torch.fx.GraphModule, config: dict) -> list:
    from neural_compressor.torch.quantization import StaticQuantConfig

    keep_float: list[str] = []
    if config["layers"] == "all-but-ends":
        names = _layer_names(exported)
        keep_float = sorted(set(names[:1] + names[-1:]))
    elif config["layers"] != "all":
        raise ValueError(f"{INC_KIND}: unknown layer selection {config['layers']!r}")
    configs = []
    for algo in config["act_algos"]:
        quant = StaticQuantConfig(
            w_dtype="int8", w_sym=True, w_granularity="per_channel", act_dtype="uint8", act_sym=False, act_algo=algo
        )
        for name in keep_float:
            quant.set_local(name, StaticQuantConfig(w_dtype="fp32", act_dtype="fp32"))
        configs.append(quant)
    return configs


def _describe(quant_config) -> dict:
    """A plain-data summary of one neural-compressor config, for the trial record."""
    local = sorted(getattr(quant_config, "local_config", {}) or {})
    return {"act_algo": quant_config.act_algo, "act_dtype": quant_config.act_dtype, "float_layers": local}


def _autotune(exported: torch.fx.GraphModule, config: dict, batches: list[tuple], score: Score):
    """neural-compressor's autotune over this trial's configurations; returns the model it chose
    and a record of every configuration it tried with its agreement score."""
    from neural_compressor.torch.quantization import TuningConfig, autotune

    configs = _inc_configs(exported, config)
    tried: list[dict] = []
    captured: list[float] = []  # autotune's baseline: the captured FP32 graph against the module

    def eval_fn(model: torch.nn.Module) -> float:
        value = score(model)
        qconfig = getattr(model, "qconfig", None)
        if isinstance(qconfig, dict) and qconfig:
            tried.append({**_describe(next(iter(qconfig.values()))), "agreement": round(value, 6)})
        else:
            captured.append(round(value, 6))
        return value

    def run_fn(model: torch.nn.Module) -> None:
        with torch.no_grad():
            for batch in batches:
                model(*batch)

    tuning = TuningConfig(config_set=configs, tolerable_loss=config["tolerable_loss"], max_trials=len(configs))
    with _quiet() as log:
        try:
            quantized = autotune(exported, tuning, eval_fn=eval_fn, run_fn=run_fn, example_inputs=batches[0])
        except Exception as exc:
            raise RuntimeError(f"{INC_KIND}: neural-compressor quantization failed: {log.reason(exc)}") from exc
    if quantized is None:
        raise RuntimeError(f"{INC_KIND}: autotune returned no model (tried {tried})")
    chosen = _describe(next(iter(quantized.qconfig.values())))
    best = max(tried, key=lambda t: t["agreement"])
    logger.info("%s %s: autotune tried %s, chose %s", INC_KIND, config["layers"], tried, chosen)
    return quantized, {
        "captured_fp32_agreement": captured[0] if captured else None,
        "tried": tried,
        "chosen": chosen,
        "calibration_agreement": best["agreement"],
        "met_tolerance": best["agreement"] >= 1 - config["tolerable_loss"],
    }


def _export_onnx(
    quantized: torch.nn.Module, graph: ServingGraph, dynamic: tuple, out: Path, *, opset: int, conv_weight_bits: int
) -> None:
    """Dynamo export with the FP32 graph's input and output names, then the clean-ups ORT needs."""
    with tempfile.TemporaryDirectory(prefix="inc-onnx-") as scratch:
        raw = Path(scratch) / "quantized.onnx"
        with _quiet() as log:
            try:
                export_onnx(replace(graph, module=quantized), raw, opset=opset, dynamic_shapes=dynamic)
            except Exception as exc:
                reason = log.reason(exc)
                raise RuntimeError(f"{INC_KIND}: dynamo ONNX export of the quantized model failed: {reason}") from exc
        model = onnx.load(str(raw))  # pulls the exporter's external weights file in
    fold_weight_quantization(model, conv_weight_bits=conv_weight_bits)
    fold_pads_into_convs(model)
    model = fuse_gelu(model)
    _name_dynamic_axes(model, graph.dynamic_axes)
    onnx.checker.check_model(model)
    onnx.save(model, str(out))


def _name_dynamic_axes(model: onnx.ModelProto, dynamic_axes: dict[str, dict[int, str]]) -> None:
    """Give the exporter's symbols ("s43") the FP32 graph's axis names ("batch") everywhere they occur."""
    graph = model.graph
    renames: dict[str, str] = {}
    for value in [*graph.input, *graph.output]:
        dims = value.type.tensor_type.shape.dim
        for axis, label in dynamic_axes.get(value.name, {}).items():
            if dims[axis].dim_param:
                renames.setdefault(dims[axis].dim_param, label)
            dims[axis].dim_param = label
    for value in [*graph.input, *graph.output, *graph.value_info]:
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param in renames:
                dim.dim_param = renames[dim.dim_param]


# --- ONNX clean-up -----------------------------------------------------------------------------


def _attribute(node: onnx.NodeProto, name: str, default: Any) -> Any:
    found = [a for a in node.attribute if a.name == name]
    return onnx.helper.get_attribute_value(found[0]) if found else default


def _per_axis(value: np.ndarray, axis: int, rank: int) -> np.ndarray:
    """Broadcast a 1-D per-channel parameter along `axis` of a rank-`rank` tensor."""
    if value.size <= 1:
        return value.reshape(())
    shape = [1] * rank
    shape[axis] = value.size
    return value.reshape(shape)


def fold_weight_quantization(model: onnx.ModelProto, *, conv_weight_bits: int = 8) -> None:
    """Rewrite float weight → QuantizeLinear [→ Clip] → DequantizeLinear [→ Transpose] as int8 weight →
    DequantizeLinear, in place: the file shrinks to int8 weights and ORT sees the QDQ pattern it fuses.

    `conv_weight_bits=7` requantizes symmetric convolution weights from the float values to [-64, 63]
    (scale × 127.5 / 63.5): without VNNI, x86 QLinearConv multiplies u8 × s8 pairs into saturating
    int16 and loses accuracy with full-range weights (ORT's `reduce_range`)."""
    graph = model.graph
    inits = {init.name: init for init in graph.initializer}
    producer = {out: node for node in graph.node for out in node.output}
    uses: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            uses[name] = uses.get(name, 0) + 1
    conv_weights = {node.input[1] for node in graph.node if node.op_type == "Conv"}

    def constant(name: str) -> np.ndarray | None:
        return numpy_helper.to_array(inits[name]) if name in inits else None

    def add_constant(name: str, value: np.ndarray) -> str:
        graph.initializer.append(numpy_helper.from_array(value, name))
        inits[name] = graph.initializer[-1]
        return name

    removed: set[int] = set()
    for dq in [node for node in graph.node if node.op_type == "DequantizeLinear"]:
        chain = [producer.get(dq.input[0])]
        if chain[-1] is not None and chain[-1].op_type == "Clip":
            chain.append(producer.get(chain[-1].input[0]))
        q = chain[-1]
        if q is None or q.op_type != "QuantizeLinear" or len(q.input) != 3:
            continue
        if any(uses.get(node.output[0], 0) != 1 for node in chain):
            continue
        weight, scale, zero = (constant(name) for name in q.input)
        if weight is None or scale is None or zero is None or zero.dtype not in (np.int8, np.uint8):
            continue
        info = np.iinfo(zero.dtype)
        low, high = info.min, info.max
        for clip in chain[:-1]:
            bounds = [constant(name) if name else None for name in clip.input[1:]]
            if any(name and bound is None for name, bound in zip(clip.input[1:], bounds, strict=False)):
                break
            low = max(low, int(bounds[0])) if bounds and bounds[0] is not None else low
            high = min(high, int(bounds[1])) if len(bounds) > 1 and bounds[1] is not None else high
        else:
            axis = _attribute(q, "axis", 1) % weight.ndim
            if conv_weight_bits == 7 and dq.output[0] in conv_weights and zero.dtype == np.int8 and not zero.any():
                scale = (scale * (127.5 / 63.5)).astype(scale.dtype)
                low, high = -64, 63
                dq.input[1] = add_constant(f"{dq.output[0]}_scale", scale)
            quantized = np.rint(weight / _per_axis(scale, axis, weight.ndim)) + _per_axis(zero, axis, weight.ndim)
            dq.input[0] = add_constant(f"{dq.output[0]}_quantized", np.clip(quantized, low, high).astype(zero.dtype))
            removed |= {index for index, node in enumerate(graph.node) if any(node is c for c in chain)}

    consumers: dict[str, list[int]] = {}
    for index, node in enumerate(graph.node):
        if index not in removed:
            for name in node.input:
                consumers.setdefault(name, []).append(index)
    outputs = {o.name for o in graph.output}
    for node in graph.node:
        if node.op_type != "DequantizeLinear" or node.input[0] not in inits or node.output[0] in outputs:
            continue
        users = consumers.get(node.output[0], [])
        if len(users) != 1 or len(consumers.get(node.input[0], [])) != 1 or graph.node[users[0]].op_type != "Transpose":
            continue
        transpose = graph.node[users[0]]
        weight = constant(node.input[0])
        perm = list(_attribute(transpose, "perm", list(reversed(range(weight.ndim)))))
        inits[node.input[0]].CopyFrom(
            numpy_helper.from_array(np.ascontiguousarray(weight.transpose(perm)), node.input[0])
        )
        scale = constant(node.input[1])
        if scale is not None and scale.size > 1:
            axis = _attribute(node, "axis", 1) % weight.ndim
            node.attribute.remove(next(a for a in node.attribute if a.name == "axis"))
            node.attribute.append(onnx.helper.make_attribute("axis", perm.index(axis)))
        node.output[0] = transpose.output[0]
        removed.add(users[0])

    kept = [node for index, node in enumerate(graph.node) if index not in removed]
    del graph.node[:]
    graph.node.extend(kept)
    _drop_unused_initializers(graph)


def fuse_gelu(model: onnx.ModelProto) -> onnx.ModelProto:
    """onnxscript's ORT fusions for the exact GELU the dynamo exporter spells out (Div, Erf, Add, Mul,
    Mul) and its bias: ORT's own runtime fusion does not match that spelling. Attention fusion is
    left out on purpose: it would take the QKV weights as float and undo their int8 MatMuls."""
    import onnx_ir as ir
    from onnxscript.rewriter.ort_fusions.bias_gelu import fuse_bias_gelu
    from onnxscript.rewriter.ort_fusions.erfgelu import fuse_erfgelu

    ir_model = ir.from_proto(model)
    if not fuse_erfgelu(ir_model):
        return model
    fuse_bias_gelu(ir_model)
    fused = ir.to_proto(ir_model)
    _drop_unused_initializers(fused.graph)  # the constants of the spelled-out GELU
    return fused


def _drop_unused_initializers(graph: onnx.GraphProto) -> None:
    used = {name for node in graph.node for name in node.input} | {o.name for o in graph.output}
    for init in [init for init in graph.initializer if init.name not in used]:
        graph.initializer.remove(init)


def fold_pads_into_convs(model: onnx.ModelProto) -> None:
    """Rewrite zero Pad → QuantizeLinear → DequantizeLinear → Conv as Q → DQ → Conv with the padding in
    the Conv, in place. Exact (zero quantizes to the zero point and back), and it lets ORT fuse the
    convolution before the Pad with its output Q into a QLinearConv (same-padded depthwise convs)."""
    graph = model.graph
    inits = {init.name: init for init in graph.initializer}
    producer = {out: node for node in graph.node for out in node.output}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    graph_outputs = {o.name for o in graph.output}

    def only_consumer(name: str) -> onnx.NodeProto | None:
        users = consumers.get(name, [])
        return users[0] if len(users) == 1 and name not in graph_outputs else None

    folded: list[onnx.NodeProto] = []
    unpadded: set[str] = set()
    for conv in graph.node:
        if conv.op_type != "Conv" or _attribute(conv, "auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET"):
            continue
        dq = producer.get(conv.input[0])
        q = producer.get(dq.input[0]) if dq is not None and dq.op_type == "DequantizeLinear" else None
        pad = producer.get(q.input[0]) if q is not None and q.op_type == "QuantizeLinear" else None
        if pad is None or pad.op_type != "Pad" or only_consumer(dq.output[0]) is not conv:
            continue
        if only_consumer(q.output[0]) is not dq or only_consumer(pad.output[0]) is not q:
            continue
        if _attribute(pad, "mode", b"constant") not in (b"constant", "constant") or len(pad.input) > 3:
            continue
        if pad.input[1] not in inits or (len(pad.input) > 2 and pad.input[2] and pad.input[2] not in inits):
            continue
        if len(pad.input) > 2 and pad.input[2] and numpy_helper.to_array(inits[pad.input[2]]).any():
            continue
        pads = numpy_helper.to_array(inits[pad.input[1]]).astype(int).tolist()
        rank = len(pads) // 2
        begins, ends = pads[:rank], pads[rank:]
        if begins[:2] != [0, 0] or ends[:2] != [0, 0] or min(pads) < 0:
            continue
        current = list(_attribute(conv, "pads", [0] * (2 * (rank - 2))))
        spatial = rank - 2
        merged = [current[i] + begins[2 + i] for i in range(spatial)] + [
            current[spatial + i] + ends[2 + i] for i in range(spatial)
        ]
        for old in [a for a in conv.attribute if a.name == "pads"]:
            conv.attribute.remove(old)
        conv.attribute.append(onnx.helper.make_attribute("pads", merged))
        q.input[0] = pad.input[0]
        folded.append(pad)
        unpadded |= {pad.output[0], q.output[0], dq.output[0]}
    for value in [value for value in graph.value_info if value.name in unpadded]:
        graph.value_info.remove(value)  # their recorded shapes still include the padding
    for pad in folded:
        graph.node.remove(pad)
    _drop_unused_initializers(graph)


class _quiet(logging.Handler):
    """neural-compressor and the exporters log every step at INFO and warn about tracing details; the
    trial record carries what matters. Errors they log (neural-compressor's export logs the reason
    and raises a generic error) are kept, to be named in the exception."""

    LOGGERS = ("neural_compressor", "torch.onnx", "torch.export", "torch._export", "onnxscript")

    def __init__(self) -> None:
        super().__init__(level=logging.ERROR)
        self.errors: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.errors.append(record.getMessage().strip().splitlines()[0][:500])

    def reason(self, exc: Exception) -> str:
        return "; ".join([*self.errors[-1:], str(exc).strip().splitlines()[0][:500]])

    def __enter__(self) -> _quiet:
        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        warnings.simplefilter("ignore")
        self._levels = {}
        for name in self.LOGGERS:
            log = logging.getLogger(name)
            self._levels[name] = log.level
            log.setLevel(logging.ERROR)
            log.addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        for name, level in self._levels.items():
            logging.getLogger(name).setLevel(level)
            logging.getLogger(name).removeHandler(self)
        self._warnings.__exit__(*exc)

"""Writes int8_scores.onnx, the one-operator graph of :mod:`service.gallery.int8_scan`.

    .venv/bin/python -m service.gallery.make_int8_scores_onnx

Needs the ``onnx`` package (the ``train`` extra); the service itself only loads the file.
tests/test_int8_scan.py checks that the committed file is what this writes.
"""

from __future__ import annotations

from pathlib import Path


def build_model_bytes() -> bytes:
    from onnx import TensorProto, helper

    codes = helper.make_tensor_value_info("codes", TensorProto.UINT8, ["rows", "dim"])
    query = helper.make_tensor_value_info("query", TensorProto.INT8, ["dim", "queries"])
    scores = helper.make_tensor_value_info("scores", TensorProto.INT32, ["rows", "queries"])
    zero_point = helper.make_tensor("zero_point", TensorProto.UINT8, [], [128])
    node = helper.make_node("MatMulInteger", ["codes", "query", "zero_point"], ["scores"])
    graph = helper.make_graph([node], "int8_scores", [codes, query], [scores], initializer=[zero_point])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], producer_name="sphereface")
    model.ir_version = 8
    return model.SerializeToString()


def main() -> None:
    out = Path(__file__).with_name("int8_scores.onnx")
    out.write_bytes(build_model_bytes())
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

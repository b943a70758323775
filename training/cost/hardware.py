"""Published figures of the GPUs the shipped instance types carry: peak dense throughput per
precision, memory bandwidth and memory size, each from its vendor's datasheet.

Dense figures only: the datasheets' larger "with sparsity" numbers need 2:4 structured-sparse
weights, which no model here has. `None` marks a precision the GPU has no tensor cores for
(Turing and Volta have no bf16 or tf32); a run there uses fp16 (`train.precision: auto`).

Sources (read 2026-11-26):
- T4: NVIDIA T4 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/tesla-t4): FP32 8.1
  TFLOPS, mixed-precision FP16/FP32 65 TFLOPS, 16 GB GDDR6 at 320 GB/s.
- A10G (AWS G5 only, not the retail A10): NVIDIA's A10G figures as AWS quotes them
  (baseten.co/blog/nvidia-a10-vs-a10g-for-ml-model-inference): FP32 31.52, TF32 35, BF16 and
  FP16 70 TFLOPS dense, 24 GB GDDR6 at 600 GB/s.
- V100 SXM2 16 GB: NVIDIA V100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/v100):
  FP32 15.7, tensor FP16 125 TFLOPS, 900 GB/s.
- A100 SXM4 40 GB / 80 GB, A100 PCIe 80 GB: NVIDIA A100 datasheet
  (nvidia.com/en-us/data-center/a100): FP32 19.5, TF32 156, BF16 and FP16 312 TFLOPS; 1,555,
  2,039 and 1,935 GB/s.
- H100 SXM5: NVIDIA H100 datasheet (nvidia.com/en-us/data-center/h100): FP32 67, TF32 494.5,
  BF16 and FP16 989.5 TFLOPS dense (half the sparse 989 and 1,979), 80 GB HBM3 at 3.35 TB/s.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

__all__ = ["GpuSpec", "GPUS", "peak_flops"]


class GpuSpec(BaseModel):
    model_config = ConfigDict(frozen=True)

    name: str
    fp32_tflops: float
    tf32_tflops: float | None
    bf16_tflops: float | None
    fp16_tflops: float
    memory_gb: float
    bandwidth_gbs: float
    source: str


_NV = "nvidia.com/en-us/data-center/"
GPUS: dict[str, GpuSpec] = {g.name: g for g in (
    GpuSpec(name="T4", fp32_tflops=8.1, tf32_tflops=None, bf16_tflops=None, fp16_tflops=65.0, memory_gb=16,
            bandwidth_gbs=320, source=_NV + "tesla-t4 (T4 datasheet)"),
    GpuSpec(name="A10G", fp32_tflops=31.52, tf32_tflops=35.0, bf16_tflops=70.0, fp16_tflops=70.0, memory_gb=24,
            bandwidth_gbs=600, source="NVIDIA A10G figures as AWS quotes them, "
            "baseten.co/blog/nvidia-a10-vs-a10g-for-ml-model-inference"),
    GpuSpec(name="V100-16GB", fp32_tflops=15.7, tf32_tflops=None, bf16_tflops=None, fp16_tflops=125.0,
            memory_gb=16, bandwidth_gbs=900, source=_NV + "v100 (V100 SXM2 datasheet)"),
    GpuSpec(name="A100-40GB", fp32_tflops=19.5, tf32_tflops=156.0, bf16_tflops=312.0, fp16_tflops=312.0,
            memory_gb=40, bandwidth_gbs=1555, source=_NV + "a100 (A100 SXM4 40 GB datasheet)"),
    GpuSpec(name="A100-80GB", fp32_tflops=19.5, tf32_tflops=156.0, bf16_tflops=312.0, fp16_tflops=312.0,
            memory_gb=80, bandwidth_gbs=2039, source=_NV + "a100 (A100 SXM4 80 GB datasheet)"),
    GpuSpec(name="A100-80GB-PCIe", fp32_tflops=19.5, tf32_tflops=156.0, bf16_tflops=312.0, fp16_tflops=312.0,
            memory_gb=80, bandwidth_gbs=1935, source=_NV + "a100 (A100 PCIe 80 GB datasheet)"),
    GpuSpec(name="H100", fp32_tflops=67.0, tf32_tflops=494.5, bf16_tflops=989.5, fp16_tflops=989.5, memory_gb=80,
            bandwidth_gbs=3350, source=_NV + "h100 (H100 SXM5 datasheet)"),
)}


def peak_flops(gpu: GpuSpec, precision: str) -> tuple[float, str]:
    """(FLOP/s, the precision it runs in) of `precision` ("auto", "bf16", "fp16", "fp32") on
    `gpu`: auto is bf16 where the GPU has it, else fp16, as `train.precision: auto` resolves on
    CUDA. fp32 matmuls stay fp32 (the trainer does not enable TF32)."""
    if precision == "auto":
        precision = "bf16" if gpu.bf16_tflops is not None else "fp16"
    if precision == "bf16" and gpu.bf16_tflops is None:
        return gpu.fp32_tflops * 1e12, "fp32"  # bf16 without tensor cores for it: emulated, no faster
    table = {"fp32": gpu.fp32_tflops, "bf16": gpu.bf16_tflops, "fp16": gpu.fp16_tflops}
    return float(table[precision] or gpu.fp32_tflops) * 1e12, precision

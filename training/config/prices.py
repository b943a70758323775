"""The shipped price table: what `retrain plan` compares and what a run's bill is priced at.

Source, for every cloud instance below: SkyPilot's catalog, which its maintainers regenerate
from the AWS Price List API and EC2's spot price history
(github.com/skypilot-org/skypilot-catalog, `catalogs/v7/aws/vms.csv` at commit
001367d22a0033fac286a8c71aeac7109e431bcb, read 2026-11-23). Region us-east-1, Linux:

- `on_demand_per_hour`: the list price of the whole instance;
- `spot_per_hour`: the median over the region's availability zones of the spot price captured
  in that commit (spot prices move by zone and hour: the zones spanned, e.g. p4d.24xlarge
  $5.09-$9.61/h and p5.48xlarge $20.99-$30.33/h).

GCP, from `catalogs/v7/gcp/vms.csv` at commit 017e2502fb63c7a28757acd94002b2d6099d3e3d (read
2026-11-23), region us-central1 (every zone there has
the same price): the catalog prices an A2 machine's host VM on one row and its A100 GPUs on a
separate accelerator row (empty InstanceType, AcceleratorName A100, AcceleratorCount n), so each
entry below is host + GPUs, on-demand and spot alike:

- a2-highgpu-1g: host $0.73948 / $0.29576 + 1x A100 $2.93391 / $1.1472;
- a2-highgpu-8g: host $5.91582 / $2.36604 + 8x A100 $23.47126 / $9.1776.

Azure, from `catalogs/v6/azure/vms.csv` at commit 098741e70562f65d7af1cceb81e33b284f742604 (read
2026-11-23; the newest Azure catalog file reachable from here), region eastus, one row per instance (GPUs
included): Standard_NC4as_T4_v3, Standard_NC24ads_A100_v4, Standard_ND96amsr_A100_v4.

CPU instances: AWS's compute-optimised c6i family (Intel Xeon Ice Lake, 2 vCPUs per physical
core), from the same AWS file and commit, us-east-1, priced as above. `vcpus` and `memory_gb` (the
catalog's MemoryGiB in GB) come from its columns; spot is the median of the region's five zones
(c6i.large $0.0248-$0.0317/h, c6i.8xlarge $0.4865-$0.5709/h). `retrain plan` predicts their step
time from the one it measures where it runs, carried to their cores (`training.cost.cpu_step`).

`gpu` names the GPU in `training.cost.hardware.GPUS` (its published throughput, bandwidth and
memory, with sources) and `vcpus` the host's vCPUs, both from the same catalogs' columns.
`gpu_memory_gb` is each GPU's memory as its vendor's datasheet gives it (NVIDIA T4 16 GB, A10G
24 GB, V100 16 GB on p3, A100 40 GB on p4d and a2-highgpu, A100 80 GB on the Azure A100 v4
sizes, H100 80 GB), matching the cloud's own instance-type pages; `retrain plan` refuses an
instance whose GPU the model would not fit.

Add any instance type, cloud or region of yours in `cost.prices` (YAML); your entries are merged
over these.
"""

from __future__ import annotations


__all__ = ["DEFAULT_PRICES", "DEFAULT_STORAGE_PRICES", "PRICE_SOURCE"]

PRICE_SOURCE = ("skypilot-catalog (read 2026-11-23): catalogs/v7/aws/vms.csv @ 001367d, us-east-1; "
                "catalogs/v7/gcp/vms.csv @ 017e250, us-central1 (host + GPU rows); "
                "catalogs/v6/azure/vms.csv @ 098741e, eastus")

DEFAULT_PRICES: dict[str, dict[str, float | str | None]] = {
    # Your own machine: no marginal compute bill.
    "local-cpu": {"gpus": 0, "on_demand_per_hour": 0.0, "spot_per_hour": 0.0},
    # AWS CPU instances (see above).
    "c6i.large": {"gpus": 0, "vcpus": 2, "memory_gb": 4.29, "on_demand_per_hour": 0.085, "spot_per_hour": 0.0262},
    "c6i.xlarge": {"gpus": 0, "vcpus": 4, "memory_gb": 8.59, "on_demand_per_hour": 0.17, "spot_per_hour": 0.0674},
    "c6i.2xlarge": {"gpus": 0, "vcpus": 8, "memory_gb": 17.18, "on_demand_per_hour": 0.34, "spot_per_hour": 0.1639},
    "c6i.4xlarge": {"gpus": 0, "vcpus": 16, "memory_gb": 34.36, "on_demand_per_hour": 0.68, "spot_per_hour": 0.2994},
    "c6i.8xlarge": {"gpus": 0, "vcpus": 32, "memory_gb": 68.72, "on_demand_per_hour": 1.36, "spot_per_hour": 0.5211},
    "g4dn.xlarge": {"gpus": 1, "gpu": "T4", "vcpus": 4, "gpu_memory_gb": 16, "on_demand_per_hour": 0.526, "spot_per_hour": 0.1869},  # 1x T4 16 GB
    "g5.xlarge": {"gpus": 1, "gpu": "A10G", "vcpus": 4, "gpu_memory_gb": 24, "on_demand_per_hour": 1.006, "spot_per_hour": 0.4028},  # 1x A10G 24 GB
    "g5.12xlarge": {"gpus": 4, "gpu": "A10G", "vcpus": 48, "gpu_memory_gb": 24, "on_demand_per_hour": 5.672, "spot_per_hour": 2.5445},  # 4x A10G
    "p3.2xlarge": {"gpus": 1, "gpu": "V100-16GB", "vcpus": 8, "gpu_memory_gb": 16, "on_demand_per_hour": 3.06, "spot_per_hour": 0.6929},  # 1x V100 16 GB
    "p3.8xlarge": {"gpus": 4, "gpu": "V100-16GB", "vcpus": 32, "gpu_memory_gb": 16, "on_demand_per_hour": 12.24, "spot_per_hour": 1.936},  # 4x V100
    "p4d.24xlarge": {"gpus": 8, "gpu": "A100-40GB", "vcpus": 96, "gpu_memory_gb": 40, "on_demand_per_hour": 32.7726, "spot_per_hour": 6.7915},  # 8x A100 40 GB
    "p5.48xlarge": {"gpus": 8, "gpu": "H100", "vcpus": 192, "gpu_memory_gb": 80, "on_demand_per_hour": 98.32, "spot_per_hour": 26.7861},  # 8x H100 80 GB
    # GCP us-central1, host + GPUs (see above).
    "a2-highgpu-1g": {"gpus": 1, "gpu": "A100-40GB", "vcpus": 12, "gpu_memory_gb": 40, "on_demand_per_hour": 3.67339, "spot_per_hour": 1.44296},  # 1x A100 40 GB
    "a2-highgpu-8g": {"gpus": 8, "gpu": "A100-40GB", "vcpus": 96, "gpu_memory_gb": 40, "on_demand_per_hour": 29.38708, "spot_per_hour": 11.54364},  # 8x A100 40 GB
    # Azure eastus.
    "Standard_NC4as_T4_v3": {"gpus": 1, "gpu": "T4", "vcpus": 4, "gpu_memory_gb": 16, "on_demand_per_hour": 0.526, "spot_per_hour": 0.062699},  # 1x T4
    "Standard_NC24ads_A100_v4": {"gpus": 1, "gpu": "A100-80GB-PCIe", "vcpus": 24, "gpu_memory_gb": 80, "on_demand_per_hour": 3.673, "spot_per_hour": 0.444433},  # 1x A100 80 GB
    "Standard_ND96amsr_A100_v4": {"gpus": 8, "gpu": "A100-80GB", "vcpus": 96, "gpu_memory_gb": 80, "on_demand_per_hour": 32.77, "spot_per_hour": 3.6047},  # 8x A100 80 GB
}

# AWS S3 list prices per GB-month, us-east-1: Standard, Standard-IA, Glacier Instant Retrieval.
DEFAULT_STORAGE_PRICES = {"STANDARD": 0.023, "STANDARD_IA": 0.0125, "GLACIER_IR": 0.004}

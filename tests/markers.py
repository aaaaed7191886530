"""Which test modules need what beyond the core, as pytest markers (registered in pyproject.toml).

``pytest -m "not vllm and not ray and not s3 and not slow"`` runs the core alone (eager models, the
address space, caches, edits, analysis, datasets on local disk); ``make test`` runs everything. A
module is marked by name here rather than in its own file, so one table says what each needs; a
module that runs both backends (``test_hostile``) marks its vLLM cases by parameter.
"""

from __future__ import annotations

#: module -> the markers of every test in it
MODULES: dict[str, tuple[str, ...]] = {
    # a vLLM engine (15-40 s to start)
    **{m: ("vllm",) for m in (
        "test_vllm_compat", "test_vllm_hooks", "test_vllm_memory", "test_vllm_parity", "test_vllm_rows",
        "test_vllm_seed", "test_vllm_serving", "test_vllm_tp", "test_edits_vllm", "test_edits_vllm_tp",
        "test_moe_vllm", "test_moe_vllm_tp", "test_positions_vllm", "test_streams_vllm", "test_load", "test_facts",
        "test_family_gpt_vllm", "test_tl_vllm", "test_vllm_limits", "test_features_vllm", "test_family_vllm",
        "test_prefix_vllm")},
    # a Ray cluster (local, token auth)
    **{m: ("ray",) for m in (
        "test_cluster", "test_cluster_configs", "test_features_cluster", "test_dataset_ray", "test_edits_cluster", "test_positions_cluster",
        "test_security", "test_jobs", "test_docs", "test_family_cluster", "test_service", "test_service_features",
        "test_service_scaling", "test_tl_cluster", "test_service_lifecycle", "test_service_body_limits")},
    "test_cluster_vllm": ("ray", "vllm"),
    "test_service_vllm": ("ray", "vllm"),
    "test_cancel": ("ray", "vllm"),
    "test_dataset_speed": ("vllm",),
    "test_cluster_s3": ("ray", "s3"),
    # a local S3 server (moto_server)
    "test_dataset_s3": ("s3",),
    "test_hostile_dataset": ("s3",),
    # the embedded SmolLM2 (135M) or the whole demo
    "test_demo": ("ray", "slow"),
    "test_seed": ("slow",),
    "test_tutorial": ("slow",),
    "test_gpu_check": ("slow",),
    "test_bench_smoke": ("slow",),
}

#: a parameter value that marks the one test case it selects
PARAMS: dict[str, str] = {"vllm": "vllm", "cluster": "ray"}
#: a fixture that marks every test asking for it by name (a vLLM replica of a shared cluster)
FIXTURES: dict[str, str] = {"cluster_vllm": "vllm"}


def markers_of(module: str, params: dict, fixtures=()) -> set[str]:
    """The markers of a test in ``module`` called with ``params`` (its parametrization) and
    asking for ``fixtures``."""
    found = set(MODULES.get(module, ()))
    found |= {mark for value, mark in PARAMS.items() if value in params.values()}
    found |= {mark for name, mark in FIXTURES.items() if name in fixtures}
    return found

"""Unit tests for smsdp.config and smsdp.config.instance_types (no processes but one import check)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from smsdp.config import (
    CONFIG_ENV_VAR,
    SCRATCH_BUFFER_ENV_VAR,
    SORT_BUFFER_ENV_VAR,
    ConfigError,
    Distribution,
    ModelParallelOptions,
    MPIOptions,
    RuntimeConfig,
    SMDDPBuffers,
    SMPParameters,
    default_processes_per_host,
    resolve_job_config,
)
from smsdp.config.instance_types import INSTANCE_TYPES, InstanceType, lookup
from tests.sagemaker_docs_examples import docs_p3_distribution, docs_p4d_distribution

REPO_ROOT = Path(__file__).resolve().parents[2]
PARAMS = "smdistributed.modelparallel.parameters"
MiB = 1024 * 1024


def dist(parameters=None, *, mpi=None, **modelparallel):
    """A distribution dict in the shape the SageMaker docs use."""
    mp = {"enabled": True, **modelparallel}
    if parameters is not None:
        mp["parameters"] = parameters
    mpi = {"enabled": True, "processes_per_host": 8} if mpi is None else mpi
    return {"smdistributed": {"modelparallel": mp}, "mpi": mpi}


def error_of(fn, *args, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        fn(*args, **kwargs)
    return str(info.value)


def paths_of(fn, *args, **kwargs) -> list[str]:
    with pytest.raises(ConfigError) as info:
        fn(*args, **kwargs)
    return [p.dotted_path for p in info.value.problems]


# --------------------------------------------------------------------- import hygiene


def test_import_config_does_not_import_torch():
    code = "import smsdp.config, smsdp.config.instance_types, sys; assert 'torch' not in sys.modules, 'torch imported'"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_import_estimator_does_not_import_torch():
    """The client side (the Estimator, its CLI, its backends' dry runs) never needs torch."""
    code = (
        "import sys, estimator, estimator.cli, estimator.estimator, estimator.spec, estimator.backends.local, "
        "estimator.backends.sagemaker, smsdp.config, smsdp.config.topology, smsdp.config.shard_layout; "
        "from estimator import Estimator; "
        "assert 'torch' not in sys.modules, 'torch imported: ' + repr(sorted(m for m in sys.modules if 'torch' in m))"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


# --------------------------------------------------------------------- SageMaker docs


def test_docs_example_sharded_data_parallelism_p3():
    distribution = docs_p3_distribution()  # verbatim from the docs, see tests/sagemaker_docs_examples.py

    config = resolve_job_config(distribution, instance_type="ml.p3.16xlarge", instance_count=1)

    assert config.world_size == 8
    assert config.processes_per_host == 8
    assert config.parameters.sharded_data_parallel_degree == 2
    assert config.parameters.ddp is True
    assert config.topology.replication_degree == 4
    assert config.parameters == SMPParameters(ddp=True, sharded_data_parallel_degree=2)


def test_docs_example_smddp_collectives_p4d():
    distribution = docs_p4d_distribution()  # verbatim from the docs, see tests/sagemaker_docs_examples.py

    config = resolve_job_config(distribution, instance_type="ml.p4d.24xlarge", instance_count=8)

    assert config.world_size == 64
    assert config.parameters.sharded_data_parallel_degree == 64
    assert config.parameters.pipeline_parallel_degree == 1
    assert config.parameters.bf16 and config.parameters.compute_dtype_name == "bfloat16"
    assert config.parameters.ddp_dist_backend == "auto"
    assert config.topology.replication_degree == 1


def test_docs_mixed_precision_snippets():
    # The fp16 / bf16 smp_options of the same page, with the mpi_options of its examples.
    for key in ("fp16", "bf16"):
        smp_options = {"enabled": True, "parameters": {"ddp": True, "sharded_data_parallel_degree": 2, key: True}}
        config = resolve_job_config(
            {"smdistributed": {"modelparallel": smp_options}, "mpi": {"enabled": True, "processes_per_host": 8}},
            instance_type="ml.p4d.24xlarge",
        )
        assert getattr(config.parameters, key) is True


def test_python_sdk_pipeline_example_is_rejected_clearly():
    # The SMP v1 example of https://sagemaker.readthedocs.io/en/stable/api/training/smd_model_parallel_general.html
    # asks for pipeline parallelism (partitions=2), which smsdp does not implement.
    smp_options = {
        "enabled": True,
        "parameters": {
            "microbatches": 4,
            "placement_strategy": "spread",
            "pipeline": "interleaved",
            "optimize": "speed",
            "partitions": 2,
            "ddp": True,
        },
    }
    mpi_options = {
        "enabled": True,
        "processes_per_host": 8,
        "custom_mpi_options": "--mca btl_vader_single_copy_mechanism none ",
    }
    message = error_of(
        resolve_job_config,
        {"smdistributed": {"modelparallel": smp_options}, "mpi": mpi_options},
        instance_type="ml.p3.16xlarge",
    )
    assert f"{PARAMS}.pipeline_parallel_degree=2" in message
    assert "does not implement pipeline parallelism; use 1" in message


# ---------------------------------------------------------------------- SMPParameters


def test_parameter_defaults_match_smp_docs():
    p = SMPParameters()
    assert p.sharded_data_parallel_degree == 1
    assert p.sdp_reduce_bucket_size == 500_000_000
    assert p.sdp_param_persistence_threshold == 1_000_000
    assert p.sdp_max_live_parameters == 1_000_000_000
    assert p.sdp_hierarchical_allgather is True
    assert p.sdp_gradient_clipping == 1.0
    assert p.tensor_parallel_degree == 1
    assert p.pipeline_parallel_degree == 1
    assert p.microbatches == 1
    assert (p.ddp, p.bf16, p.fp16, p.prescaled_batch) == (False, False, False, False)
    assert p.ddp_dist_backend == "auto"
    assert (p.delayed_parameter_initialization, p.shard_optimizer_state, p.offload_activations) == (False,) * 3
    assert p.activation_loading_horizon == 4
    assert p.activation_checkpointing is False
    assert p.compute_dtype_name == "float32"
    assert not p.sharding_enabled


@pytest.mark.parametrize(
    ("key", "written", "expected"),
    [
        ("sdp_reduce_bucket_size", 5e8, 500_000_000),
        ("sdp_param_persistence_threshold", 1e6, 1_000_000),
        ("sdp_max_live_parameters", 1e9, 1_000_000_000),
        ("sharded_data_parallel_degree", 2.0, 2),
        ("microbatches", 4.0, 4),
    ],
)
def test_float_written_ints_are_ints(key, written, expected):
    value = getattr(SMPParameters.model_validate({key: written}), key)
    assert value == expected and type(value) is int


@pytest.mark.parametrize("bad", [1.5, 5e8 + 0.5, True, "8", float("nan")])
def test_non_whole_numbers_are_rejected_for_int_fields(bad):
    message = error_of(SMPParameters.model_validate, {"sdp_reduce_bucket_size": bad})
    assert message.startswith(f"sdp_reduce_bucket_size={bad!r} is invalid")
    assert "use e.g. 500000000 (the default)" in message


@pytest.mark.parametrize(
    ("key", "bad", "default"),
    [
        ("sharded_data_parallel_degree", 0, 1),
        ("microbatches", 0, 1),
        ("tensor_parallel_degree", -1, 1),
        ("sdp_reduce_bucket_size", 0, 500000000),
        ("sdp_max_live_parameters", 0, 1000000000),
        ("sdp_param_persistence_threshold", -1, 1000000),
        ("sdp_gradient_clipping", -0.5, 1.0),
        ("activation_loading_horizon", -1, 4),
        ("memory_weight", 1.5, 0.8),
    ],
)
def test_bounds(key, bad, default):
    message = error_of(SMPParameters.model_validate, {key: bad})
    assert f"{key}={bad!r} is invalid" in message
    assert f"use e.g. {default!r} (the default)" in message


def test_sdp_reshard_after_forward_accepts_the_two_strategies():
    assert SMPParameters().sdp_reshard_after_forward is True
    assert SMPParameters.model_validate({"sdp_reshard_after_forward": False}).sdp_reshard_after_forward is False


@pytest.mark.parametrize("bad", [3, 0, "false", 1.5])
def test_sdp_reshard_after_forward_rejects_what_is_not_built(bad):
    message = error_of(
        SMPParameters.model_validate, {"sharded_data_parallel_degree": 4, "sdp_reshard_after_forward": bad}
    )
    assert "sdp_reshard_after_forward" in message, message
    if isinstance(bad, int):
        assert "use True" in message and "False" in message, message


@pytest.mark.parametrize("k, reshard_degree", [(2, 2), (4, None)])
def test_sdp_reshard_after_forward_accepts_a_divisor_of_the_shard_degree(k, reshard_degree):
    """k splits each shard group into groups of k ranks; k = d is True (no groups to make)."""
    config = resolve_job_config(
        dist(
            {"sharded_data_parallel_degree": 4, "sdp_reshard_after_forward": k},
            mpi={"enabled": True, "processes_per_host": 2},
        ),
        instance_count=4,
    )
    assert config.parameters.sdp_reshard_after_forward == k
    topology = config.topology
    assert topology.reshard_degree == reshard_degree
    if reshard_degree:
        assert topology.reshard_groups() == ((0, 1), (2, 3), (4, 5), (6, 7))
        assert topology.coords(3).reshard_group == (2, 3)
        assert "reshard to 2 after forward" in topology.describe()


@pytest.mark.parametrize(
    "k, d, says",
    [
        (3, 4, "does not divide sharded_data_parallel_degree=4"),
        (8, 4, "does not divide sharded_data_parallel_degree=4"),
        (1, 4, "would keep every unit whole until its backward, which is False written as a bool"),
        (0, 4, "must be at least 2"),
        (-2, 4, "must be at least 2"),
        (2, 1, "does not divide sharded_data_parallel_degree=1"),
    ],
)
def test_sdp_reshard_after_forward_int_rules_name_field_value_why_and_fix(k, d, says):
    message = error_of(
        SMPParameters.model_validate, {"sharded_data_parallel_degree": d, "sdp_reshard_after_forward": k}
    )
    assert message.startswith(f"sdp_reshard_after_forward={k!r} {says}"), message
    assert "use True (reshard every unit after its forward), False (keep every unit gathered" in message
    if d == 4:
        assert message.endswith("or a divisor of 4 from 2 up: 2 or 4"), message
    else:
        assert message.endswith("(sharded_data_parallel_degree=1 leaves no int to choose)"), message


def test_reshard_after_forward_says_it_takes_a_whole_number_too():
    message = error_of(SMPParameters, sdp_reshard_after_forward="yes")
    assert "True, False or a whole number k that divides sharded_data_parallel_degree" in message
    assert "use True or False" not in message


def test_sdp_reshard_after_forward_groups_must_each_lie_on_one_host():
    """d=6 over hosts of 3: the group of shard ranks 2-3 would straddle two hosts; 3 fits."""
    distribution = dist(
        {"sharded_data_parallel_degree": 6, "sdp_reshard_after_forward": 2},
        mpi={"enabled": True, "processes_per_host": 3},
    )
    message = error_of(resolve_job_config, distribution, instance_count=2)
    assert message == (
        f"{PARAMS}.sdp_reshard_after_forward=2 does not fit the hosts: reshard group (2, 3) of 2 consecutive "
        "shard ranks spans hosts [0, 1] (world size 6 = 2 instances x 3 processes per host); the backward's "
        "all-gather runs inside each group of 2 consecutive shard ranks, so each must lie on one host; "
        "use True, False, or 3, whose groups each lie on one host"
    )
    fits = dist(
        {"sharded_data_parallel_degree": 6, "sdp_reshard_after_forward": 3},
        mpi={"enabled": True, "processes_per_host": 3},
    )
    assert resolve_job_config(fits, instance_count=2).topology.reshard_groups() == ((0, 1, 2), (3, 4, 5))


def test_sdp_reshard_after_forward_groups_across_hosts_without_a_fit_offer_only_the_bools():
    distribution = dist(
        {"sharded_data_parallel_degree": 4, "sdp_reshard_after_forward": 2},
        mpi={"enabled": True, "processes_per_host": 1},
    )
    message = error_of(resolve_job_config, distribution, instance_count=4)
    assert message.endswith("so each must lie on one host; use True, False"), message


def test_sdp_reshard_after_forward_is_checked_on_the_ranks_too():
    """smp.init({...}) builds its config with for_world: the same host rule holds there."""
    message = error_of(
        RuntimeConfig.for_world, 4, 1, {"sharded_data_parallel_degree": 4, "sdp_reshard_after_forward": 2}
    )
    assert message.startswith("parameters.sdp_reshard_after_forward=2 does not fit the hosts"), message
    config = RuntimeConfig.for_world(4, 2, {"sharded_data_parallel_degree": 4, "sdp_reshard_after_forward": 2})
    assert RuntimeConfig.model_validate_json(config.to_env_value()).topology.reshard_degree == 2


def test_prefetch_depths_default_to_one_unit_ahead_and_accept_zero_and_more():
    assert (SMPParameters().sdp_forward_prefetch, SMPParameters().sdp_backward_prefetch) == (1, 1)
    p = SMPParameters.model_validate({"sdp_forward_prefetch": 0, "sdp_backward_prefetch": 3.0})
    assert (p.sdp_forward_prefetch, p.sdp_backward_prefetch) == (0, 3)
    assert type(p.sdp_backward_prefetch) is int


@pytest.mark.parametrize("key, direction", [("sdp_forward_prefetch", "forward"), ("sdp_backward_prefetch", "backward")])
def test_a_negative_prefetch_depth_names_field_value_why_and_fix(key, direction):
    message = error_of(SMPParameters.model_validate, {key: -1})
    assert message == (
        f"{key}=-1 is a number of units to gather ahead of the one running its {direction}, so it "
        "cannot be negative; use 0 (gather each unit on demand), 1 (the default: the next unit) "
        "or more (bounded by sdp_max_live_parameters)"
    ), message


@pytest.mark.parametrize("bad", [True, 1.5, "2", None])
def test_a_prefetch_depth_is_a_whole_number(bad):
    message = error_of(SMPParameters.model_validate, {"sdp_backward_prefetch": bad})
    assert message.startswith(f"sdp_backward_prefetch={bad!r} is invalid"), message
    assert "use e.g. 1 (the default)" in message, message


def test_bounds_accept_edge_values():
    p = SMPParameters(sdp_param_persistence_threshold=0, sdp_gradient_clipping=0, activation_loading_horizon=0)
    assert p.sdp_gradient_clipping == 0.0


@pytest.mark.parametrize("key", ["bf16", "ddp", "sdp_hierarchical_allgather", "activation_checkpointing"])
def test_bools_are_strict(key):
    assert getattr(SMPParameters.model_validate({key: True}), key) is True
    message = error_of(SMPParameters.model_validate, {key: "yes"})
    assert f"{key}='yes' is invalid: input should be a valid boolean" in message


def test_the_hierarchical_reduce_scatter_is_on_by_default_and_its_key_a_strict_bool():
    assert SMPParameters().sdp_hierarchical_reduce_scatter is True
    assert SMPParameters(sdp_hierarchical_reduce_scatter=False).sdp_hierarchical_reduce_scatter is False
    message = error_of(SMPParameters.model_validate, {"sdp_hierarchical_reduce_scatter": "yes"})
    assert "sdp_hierarchical_reduce_scatter='yes' is invalid: input should be a valid boolean" in message


@pytest.mark.parametrize("backend", ["auto", "nccl", "gloo"])
def test_ddp_dist_backend_values(backend):
    assert SMPParameters(ddp_dist_backend=backend).ddp_dist_backend == backend


def test_ddp_dist_backend_rejects_others():
    message = error_of(SMPParameters, ddp_dist_backend="mpi")
    assert "ddp_dist_backend='mpi' is invalid: input should be 'auto', 'nccl' or 'gloo'" in message


def test_partitions_is_an_alias_of_pipeline_parallel_degree():
    assert SMPParameters.model_validate({"partitions": 1}).pipeline_parallel_degree == 1
    assert SMPParameters.model_validate({"partitions": 1, "pipeline_parallel_degree": 1}).pipeline_parallel_degree == 1
    message = error_of(SMPParameters.model_validate, {"partitions": 1, "pipeline_parallel_degree": 2})
    assert "partitions=1 conflicts with pipeline_parallel_degree=2" in message


def test_unknown_parameter_did_you_mean():
    message = error_of(SMPParameters.model_validate, {"sharded_data_parallel_degre": 2})
    assert message == (
        "unknown key 'sharded_data_parallel_degre' in parameters; did you mean 'sharded_data_parallel_degree'?"
    )


def test_unknown_parameter_without_close_match_lists_keys():
    message = error_of(SMPParameters.model_validate, {"zzz": 1})
    assert "unknown key 'zzz' in parameters; valid keys are" in message
    assert "'sharded_data_parallel_degree'" in message
    assert "'_match_weights'" not in message


def test_smp_v1_and_v2_keys_mixed_are_refused():  # each SMP v2 key: tests/unit/test_smp_v2_config.py
    message = error_of(SMPParameters.model_validate, {"hybrid_shard_degree": 8, "sharded_data_parallel_degree": 8})
    assert message.startswith("sharded_data_parallel_degree=8 is an SMP v1 key, and this dict also has SMP v2's")


def test_harmless_smp_keys_are_accepted():
    p = SMPParameters.model_validate(
        {
            "placement_strategy": "spread",
            "optimize": "memory",
            "pipeline": "simple",
            "auto_partition": False,
            "default_partition": 0,
            "memory_weight": 0.2,
            "microbatches": 4,
            "active_microbatches": 2,
            "deterministic_server": True,
            "contiguous": False,
            "skip_tracing": True,
            "checkpoint_attentions": True,
            "tensor_parallel_seed": 7,
            "ddp_port": 29500,
            "fast_mode": True,
            "static_mode": True,
            "offload_activations": True,
            "delayed_parameter_initialization": True,
        }
    )
    assert p.placement_strategy == "spread" and p.microbatches == 4


def test_harmless_keys_keep_smp_bounds():
    assert "default_partition=1 must be less than pipeline_parallel_degree=1; use 0" in error_of(
        SMPParameters, default_partition=1
    )
    assert "active_microbatches=3 cannot exceed microbatches=2" in error_of(
        SMPParameters, microbatches=2, active_microbatches=3
    )
    assert "placement_strategy='bogus' is invalid" in error_of(SMPParameters, placement_strategy="bogus")


def test_unsupported_features_accept_default_reject_other_values():
    assert SMPParameters(pipeline_parallel_degree=1, shard_optimizer_state=False, horovod=False)
    assert "pipeline_parallel_degree=2 is not supported" in error_of(SMPParameters, pipeline_parallel_degree=2)
    message = error_of(SMPParameters, shard_optimizer_state=True)
    assert "shard_optimizer_state=True is not supported" in message
    assert "set sharded_data_parallel_degree > 1 instead" in message
    assert "horovod=True is TensorFlow-only" in error_of(SMPParameters, horovod=True)


def test_internal_smp_keys_accepted_at_default_only():
    p = SMPParameters.model_validate({"_match_weights": False, "herring": False, "partition_file": None})
    assert not hasattr(p, "herring")
    message = error_of(SMPParameters.model_validate, {"_match_weights": True})
    assert "_match_weights=True is an internal SMP v1 setting smsdp does not support" in message
    assert "only False is accepted" in message


def test_rule_b_sharding_excludes_pipeline_and_optimizer_state_sharding():
    assert SMPParameters(sharded_data_parallel_degree=4, pipeline_parallel_degree=1, shard_optimizer_state=False)
    message = error_of(SMPParameters, sharded_data_parallel_degree=4, pipeline_parallel_degree=2)
    assert "pipeline_parallel_degree=2 cannot be combined with sharded data parallelism" in message
    assert "(sharded_data_parallel_degree=4); use 1" in message
    message = error_of(SMPParameters, sharded_data_parallel_degree=4, shard_optimizer_state=True)
    assert "shard_optimizer_state=True cannot be combined with sharded data parallelism" in message
    assert "use False" in message


def test_rule_c_fp16_and_bf16_are_exclusive():
    assert SMPParameters(bf16=True).compute_dtype_name == "bfloat16"
    assert SMPParameters(fp16=True).compute_dtype_name == "float16"
    message = error_of(SMPParameters, bf16=True, fp16=True)
    assert message == "bf16=True cannot be combined with fp16=True; set one of bf16 and fp16 to False"


def test_fp16_params_turns_fp16_on_and_counts_for_rule_c():
    assert SMPParameters(fp16_params=True).fp16 is True
    message = error_of(SMPParameters, bf16=True, fp16_params=True)
    assert "fp16_params=True turns it on" in message


def test_rule_d_tensor_parallel_with_sharding_needs_prescaled_batch():
    assert SMPParameters(tensor_parallel_degree=2)  # no sharding: no requirement
    assert SMPParameters(tensor_parallel_degree=2, sharded_data_parallel_degree=2, prescaled_batch=True)
    message = error_of(SMPParameters, tensor_parallel_degree=2, sharded_data_parallel_degree=2)
    assert "prescaled_batch=False must be True when tensor_parallel_degree=2" in message
    assert "use True" in message


def test_placement_must_keep_tensor_groups_adjacent():
    for ok in ("cluster", "DPT", "PDT", "DTP"):
        assert SMPParameters(tensor_parallel_degree=2, placement_strategy=ok)
    for bad in ("spread", "TPD", "TDP", "PTD"):
        message = error_of(SMPParameters, tensor_parallel_degree=2, placement_strategy=bad)
        assert f"placement_strategy={bad!r}" in message and "use 'cluster'" in message


def test_all_rule_violations_are_listed_together():
    with pytest.raises(ConfigError) as info:
        SMPParameters(sharded_data_parallel_degree=2, pipeline_parallel_degree=2, bf16=True, fp16=True)
    assert [p.dotted_path for p in info.value.problems] == ["pipeline_parallel_degree", "bf16"]
    assert str(info.value).startswith("2 problems in the smsdp configuration:\n  - ")


def test_parameters_are_frozen():
    p = SMPParameters()
    with pytest.raises(Exception):
        p.bf16 = True  # type: ignore[misc]


# ------------------------------------------------------------------ distribution dict


@pytest.mark.parametrize(
    ("distribution", "path", "suggestion"),
    [
        ({"smdistributd": {}}, "", "'smdistributed'"),
        ({"smdistributed": {"modelparalel": {}}}, "smdistributed", "'modelparallel'"),
        ({"smdistributed": {"modelparallel": {"enable": True}}}, "smdistributed.modelparallel", "'enabled'"),
        ({"smdistributed": {"modelparallel": {"paramters": {}}}}, "smdistributed.modelparallel", "'parameters'"),
        ({"mpi": {"enabled": True, "processes_per_hosts": 2}}, "mpi", "'processes_per_host'"),
        (dist({"sdp_max_live_param": 1}), PARAMS, "'sdp_max_live_parameters'"),
    ],
)
def test_unknown_keys_did_you_mean_at_every_level(distribution, path, suggestion):
    message = error_of(resolve_job_config, distribution)
    prefix = f"{path}: " if path else ""
    assert message.startswith(prefix + "unknown key ")
    assert f"did you mean {suggestion}?" in message


@pytest.mark.parametrize(
    "distribution",
    [
        {"pytorchddp": {"enabled": True}},
        {"parameter_server": {"enabled": True}},
        {"smdistributed": {"dataparallel": {"enabled": True}}},
    ],
)
def test_other_distribution_kinds_say_what_to_write(distribution):
    message = error_of(resolve_job_config, distribution)
    assert "is not supported" in message
    assert "smsdp runs MPI + modelparallel" in message
    assert "'mpi': {'enabled': True, 'processes_per_host'" in message


def test_rule_g_modelparallel_needs_mpi():
    message = error_of(resolve_job_config, {"smdistributed": {"modelparallel": {"enabled": True}}})
    assert message.startswith("mpi: is missing; smdistributed.modelparallel runs under MPI")
    assert "'processes_per_host'" in message
    for mpi in ({"enabled": False, "processes_per_host": 2}, {"processes_per_host": 2}):
        message = error_of(resolve_job_config, dist({}, mpi=mpi))
        assert message.startswith("mpi.enabled=False (or missing)")
        assert "set 'enabled': True with 'processes_per_host'" in message


def test_rule_g_mpi_alone_is_plain_data_parallel():
    config = resolve_job_config({"mpi": {"enabled": True, "processes_per_host": 2}}, instance_count=2)
    assert config.world_size == 4
    assert config.parameters == SMPParameters()


def test_rule_g_mpi_disabled_alone_is_rejected():
    assert "smsdp launches every rank with mpirun" in error_of(resolve_job_config, {"mpi": {"enabled": False}})


def test_rule_g_smdistributed_without_modelparallel_is_rejected():
    assert error_of(resolve_job_config, {"smdistributed": {}}).startswith("smdistributed: needs 'modelparallel'")


def test_rule_g_disabled_modelparallel_with_parameters_is_rejected():
    message = error_of(resolve_job_config, dist({"sharded_data_parallel_degree": 2}, enabled=False))
    assert message.startswith("smdistributed.modelparallel.enabled=False (or missing) but parameters are given")


def test_rule_g_disabled_modelparallel_without_parameters_is_plain_data_parallel():
    config = resolve_job_config(dist(None, enabled=False), instance_type="ml.p4d.24xlarge")
    assert config.parameters == SMPParameters() and config.world_size == 8


@pytest.mark.parametrize("distribution", [None, {}])
def test_no_distribution_is_one_process_per_host(distribution):
    config = resolve_job_config(distribution, instance_type="ml.p4d.24xlarge", instance_count=2)
    assert (config.processes_per_host, config.world_size) == (8, 16)
    assert resolve_job_config(distribution).world_size == 1


def test_distribution_instance_and_parsed_model_are_accepted():
    parsed = Distribution.model_validate(dist({"sharded_data_parallel_degree": 2}))
    assert parsed.modelparallel_enabled and parsed.processes_per_host == 8
    config = resolve_job_config(parsed, instance_type="ml.p4d.24xlarge")
    assert config.parameters.sharded_data_parallel_degree == 2


def test_option_models_directly():
    assert MPIOptions(enabled=True).processes_per_host is None
    assert "processes_per_host=0 is invalid" in error_of(MPIOptions, enabled=True, processes_per_host=0)
    assert ModelParallelOptions(enabled=True).parameters == SMPParameters()


def test_type_errors_in_sections_suggest_what_to_write():
    with pytest.raises(ConfigError) as info:
        resolve_job_config(
            {
                "smdistributed": {"modelparallel": {"enabled": "yes", "parameters": 5}},
                "mpi": {"enabled": True, "processes_per_host": "eight"},
            }
        )
    lines = str(info.value).splitlines()[1:]
    assert lines == [
        "  - smdistributed.modelparallel.enabled='yes' is invalid: input should be a valid boolean; use True or False",
        f"  - {PARAMS}=5 is invalid: input should be a valid dictionary or instance of SMPParameters; write a dict",
        "  - mpi.processes_per_host='eight' is invalid: input should be a valid integer",
    ]


def test_distribution_must_be_a_mapping():
    assert error_of(resolve_job_config, "smdistributed").startswith("distribution='smdistributed' must be a dict")


# ----------------------------------------------------------- cross-field job rules


def test_rule_a_sharded_degree_divides_data_parallel_degree():
    assert resolve_job_config(dist({"sharded_data_parallel_degree": 8}), instance_type="ml.p4d.24xlarge")
    message = error_of(resolve_job_config, dist({"sharded_data_parallel_degree": 3}), instance_type="ml.p4d.24xlarge")
    assert message.startswith(
        f"{PARAMS}.sharded_data_parallel_degree=3 does not divide the data-parallel degree 8; use 1, 2, 4 or 8"
    )
    assert "world size 8 = 1 instance x 8 processes per host" in message


def test_rule_a_counts_hosts_and_tensor_parallelism():
    params = {"sharded_data_parallel_degree": 4, "tensor_parallel_degree": 4, "prescaled_batch": True}
    config = resolve_job_config(dist(params), instance_type="ml.p4d.24xlarge", instance_count=4)
    assert (config.world_size, config.topology.dp_size, config.topology.replication_degree) == (32, 8, 2)
    params["sharded_data_parallel_degree"] = 16
    message = error_of(resolve_job_config, dist(params), instance_type="ml.p4d.24xlarge", instance_count=4)
    assert "sharded_data_parallel_degree=16 does not divide the data-parallel degree 8; use 1, 2, 4 or 8" in message
    assert "4 instances x 8 processes per host, divided by tensor_parallel_degree 4" in message


def test_rule_a_tensor_degree_divides_world():
    message = error_of(resolve_job_config, dist({"tensor_parallel_degree": 3}), instance_type="ml.p4d.24xlarge")
    assert f"{PARAMS}.tensor_parallel_degree=3 does not divide the world size 8" in message
    assert "use 1, 2, 4 or 8" in message


def test_rule_a_mentions_defaulted_processes_per_host():
    message = error_of(
        resolve_job_config,
        dist({"sharded_data_parallel_degree": 16}, mpi={"enabled": True}),
        instance_type="ml.p4d.24xlarge",
    )
    assert "the default for 'ml.p4d.24xlarge' as mpi.processes_per_host is not set" in message


def test_rule_e_processes_per_host_at_most_gpu_count():
    config = resolve_job_config(
        dist({}, mpi={"enabled": True, "processes_per_host": 4}), instance_type="ml.g5.12xlarge"
    )
    assert config.processes_per_host == 4
    message = error_of(
        resolve_job_config, dist({}, mpi={"enabled": True, "processes_per_host": 8}), instance_type="ml.g5.12xlarge"
    )
    assert (
        message == "mpi.processes_per_host=8 exceeds the 4 GPUs of ml.g5.12xlarge; use at most 4 (one process per GPU)"
    )


def test_rule_e_default_processes_per_host_is_gpu_count():
    config = resolve_job_config(dist({}, mpi={"enabled": True}), instance_type="ml.p5.48xlarge", instance_count=2)
    assert (config.processes_per_host, config.world_size) == (8, 16)
    assert default_processes_per_host("ml.g5.xlarge") == 1
    assert default_processes_per_host("ml.c5.xlarge") == 1
    assert default_processes_per_host("local") == 1


def test_rule_e_local_accepts_any_processes_per_host():
    config = resolve_job_config(dist({}, mpi={"enabled": True, "processes_per_host": 64}), instance_type="local")
    assert config.world_size == 64


def test_rule_e_cpu_instance_types_limit_by_vcpus():
    ok = resolve_job_config(dist({}, mpi={"enabled": True, "processes_per_host": 4}), instance_type="ml.c5.xlarge")
    assert ok.processes_per_host == 4
    message = error_of(
        resolve_job_config, dist({}, mpi={"enabled": True, "processes_per_host": 5}), instance_type="ml.c5.xlarge"
    )
    assert "mpi.processes_per_host=5 exceeds the 4 vCPUs of ml.c5.xlarge (no GPUs)" in message


@pytest.mark.parametrize(
    ("instance_type", "suggestion"),
    [
        ("ml.p4d.24xlage", "ml.p4d.24xlarge"),
        ("p4d.24xlarge", "ml.p4d.24xlarge"),
        ("ml.g5.12xl", "ml.g5.12xlarge"),
        ("local_gpu", "local"),
        ("Local", "local"),
    ],
)
def test_unknown_instance_types_did_you_mean(instance_type, suggestion):
    message = error_of(resolve_job_config, None, instance_type=instance_type)
    assert message.startswith(f"instance_type={instance_type!r} ")
    assert f"did you mean {suggestion!r}?" in message


@pytest.mark.parametrize("count", [0, -1, True, 1.5, "2"])
def test_instance_count_must_be_positive_int(count):
    assert error_of(resolve_job_config, None, instance_count=count).startswith(
        f"instance_count={count!r} must be a whole number >= 1"
    )


def test_rule_f_nccl_needs_gpus():
    message = error_of(resolve_job_config, dist({"ddp_dist_backend": "nccl"}), instance_type="local")
    assert message == (
        f"{PARAMS}.ddp_dist_backend='nccl' is not available: local jobs run on CPU with gloo; use 'auto' or 'gloo'"
    )
    for backend in ("auto", "gloo"):
        assert resolve_job_config(dist({"ddp_dist_backend": backend}), instance_type="local")
    for backend in ("nccl", "gloo", "auto"):
        config = resolve_job_config(dist({"ddp_dist_backend": backend}), instance_type="ml.p4d.24xlarge")
        assert config.parameters.ddp_dist_backend == backend
    message = error_of(
        resolve_job_config,
        dist({"ddp_dist_backend": "nccl"}, mpi={"enabled": True, "processes_per_host": 1}),
        instance_type="ml.m5.xlarge",
    )
    assert "NCCL needs GPUs and ml.m5.xlarge has none" in message


def test_every_problem_is_reported_at_once():
    with pytest.raises(ConfigError) as info:
        resolve_job_config(
            dist({"microbatches": 0, "sdp_reduce_bucket_size": 1.5}),
            instance_type="ml.p4d.24xlage",
            instance_count=0,
            environment={SCRATCH_BUFFER_ENV_VAR: "1000"},
        )
    paths = [p.dotted_path for p in info.value.problems]
    assert paths == [
        f"{PARAMS}.sdp_reduce_bucket_size",
        f"{PARAMS}.microbatches",
        "instance_count",
        "instance_type",
        SCRATCH_BUFFER_ENV_VAR,
    ]
    lines = str(info.value).splitlines()
    assert len(lines) == 6 and lines[0] == "5 problems in the smsdp configuration:"


def test_bad_config_fails_fast():
    bad = dist({"sharded_data_parallel_degre": 3, "bf16": True, "fp16": True})
    start = time.perf_counter()
    for _ in range(20):
        with pytest.raises(ConfigError):
            resolve_job_config(bad, instance_type="ml.p4d.24xlarge", instance_count=2)
    assert (time.perf_counter() - start) / 20 < 1.0


# ---------------------------------------------------------------------- SMDDP buffers


def test_smddp_defaults():
    buffers = SMDDPBuffers.from_environment({})
    assert (buffers.scratch_buffer_size_bytes, buffers.sort_buffer_size_bytes) == (16 * MiB, 128 * MiB)


def test_smddp_from_environment():
    buffers = SMDDPBuffers.from_environment({SCRATCH_BUFFER_ENV_VAR: "16777216", SORT_BUFFER_ENV_VAR: "8192"})
    assert (buffers.scratch_buffer_size_bytes, buffers.sort_buffer_size_bytes) == (16 * MiB, 8192)


def test_smddp_from_custom_mpi_options():
    options = (
        f"--mca btl_vader_single_copy_mechanism none -x {SCRATCH_BUFFER_ENV_VAR}=8192 -x {SORT_BUFFER_ENV_VAR}=16384"
    )
    buffers = SMDDPBuffers.from_environment({}, options)
    assert (buffers.scratch_buffer_size_bytes, buffers.sort_buffer_size_bytes) == (8192, 16384)


def test_smddp_mpi_option_wins_and_bare_x_exports_environment():
    env = {SCRATCH_BUFFER_ENV_VAR: "8192", SORT_BUFFER_ENV_VAR: "24576"}
    buffers = SMDDPBuffers.from_environment(env, f"-x {SCRATCH_BUFFER_ENV_VAR}=16384 -x {SORT_BUFFER_ENV_VAR}")
    assert (buffers.scratch_buffer_size_bytes, buffers.sort_buffer_size_bytes) == (16384, 24576)


def test_smddp_not_multiple_of_8192():
    message = error_of(SMDDPBuffers.from_environment, {SCRATCH_BUFFER_ENV_VAR: "10000"})
    assert message == f"{SCRATCH_BUFFER_ENV_VAR}=10000 (from environment) is not a multiple of 8192; use 8192 or 16384"
    message = error_of(SMDDPBuffers.from_environment, {}, f"-x {SORT_BUFFER_ENV_VAR}=100")
    assert message == f"{SORT_BUFFER_ENV_VAR}=100 (from mpi.custom_mpi_options -x) is not a multiple of 8192; use 8192"


@pytest.mark.parametrize("bad", ["-8192", "0"])
def test_smddp_negative_or_zero(bad):
    message = error_of(SMDDPBuffers.from_environment, {SORT_BUFFER_ENV_VAR: bad})
    assert message.startswith(
        f"{SORT_BUFFER_ENV_VAR}={int(bad)} (from environment) must be a positive multiple of 8192"
    )


@pytest.mark.parametrize("bad", ["abc", "16MiB", "1.5e7", ""])
def test_smddp_non_numeric(bad):
    message = error_of(SMDDPBuffers.from_environment, {SCRATCH_BUFFER_ENV_VAR: bad})
    assert message.startswith(f"{SCRATCH_BUFFER_ENV_VAR}={bad!r} (from environment) is not a whole number of bytes")
    assert "such as 16777216 (the default)" in message


def test_smddp_doc_concatenation_typo_names_the_variable():
    # The docs build custom_mpi_options with `+=` and no space between options.
    options = f"-x {SCRATCH_BUFFER_ENV_VAR}=8192" + f"-x {SORT_BUFFER_ENV_VAR}=8192"
    message = error_of(SMDDPBuffers.from_environment, {}, options)
    assert message.startswith(f"{SCRATCH_BUFFER_ENV_VAR}='8192-x' (from mpi.custom_mpi_options -x)")


def test_smddp_unbalanced_quotes():
    message = error_of(SMDDPBuffers.from_environment, {}, "-x 'A=1")
    assert message.startswith('mpi.custom_mpi_options="-x \'A=1" cannot be split into mpirun arguments')


def test_smddp_direct_construction_validates():
    assert "scratch_buffer_size_bytes=100 is not a multiple of 8192; use 8192" in error_of(
        SMDDPBuffers, scratch_buffer_size_bytes=100
    )


def test_smddp_flows_into_job_config():
    config = resolve_job_config(
        dist(
            {}, mpi={"enabled": True, "processes_per_host": 2, "custom_mpi_options": f"-x {SORT_BUFFER_ENV_VAR}=8192"}
        ),
        environment={SCRATCH_BUFFER_ENV_VAR: "16777216"},
    )
    assert config.smddp == SMDDPBuffers(scratch_buffer_size_bytes=16 * MiB, sort_buffer_size_bytes=8192)


# ---------------------------------------------------------------------- RuntimeConfig


def test_round_trip_through_environment_variable():
    config = resolve_job_config(
        dist(
            {"sharded_data_parallel_degree": 2, "bf16": True, "partitions": 1, "sdp_reduce_bucket_size": 5e8},
            mpi={"enabled": True, "processes_per_host": 2},
        ),
        instance_count=2,
        environment={SCRATCH_BUFFER_ENV_VAR: "8192"},
    )
    environ = {CONFIG_ENV_VAR: config.to_env_value()}
    assert RuntimeConfig.from_env(environ) == config
    assert json.loads(environ[CONFIG_ENV_VAR])["parameters"]["pipeline_parallel_degree"] == 1


def test_from_env_reads_os_environ(monkeypatch):
    monkeypatch.delenv(CONFIG_ENV_VAR, raising=False)
    assert RuntimeConfig.from_env() is None
    config = RuntimeConfig(processes_per_host=2, instance_count=2)
    monkeypatch.setenv(CONFIG_ENV_VAR, config.to_env_value())
    assert RuntimeConfig.from_env() == config


def test_from_env_absent_is_none():
    assert RuntimeConfig.from_env({}) is None


@pytest.mark.parametrize("raw", ["{not json", "", "[1, 2]"])
def test_from_env_malformed_names_the_variable(raw):
    message = error_of(RuntimeConfig.from_env, {CONFIG_ENV_VAR: raw})
    assert message.startswith(f"{CONFIG_ENV_VAR}=")
    assert "to_env_value()" in message


def test_from_env_invalid_content_names_the_variable_and_field():
    raw = json.dumps({"parameters": {"sharded_data_parallel_degree": 3}, "processes_per_host": 4})
    message = error_of(RuntimeConfig.from_env, {CONFIG_ENV_VAR: raw})
    assert message.startswith(
        f"{CONFIG_ENV_VAR}.parameters.sharded_data_parallel_degree=3 does not divide the data-parallel degree 4"
    )


def test_runtime_config_properties_and_bounds():
    config = RuntimeConfig(
        parameters=SMPParameters(sharded_data_parallel_degree=2), instance_count=2, processes_per_host=4
    )
    assert (config.world_size, config.topology.dp_size, config.topology.replication_degree) == (8, 8, 4)
    assert config.collective_timeout_s == 600.0 and config.instance_type == "local"
    assert "collective_timeout_s=0 is invalid" in error_of(RuntimeConfig, collective_timeout_s=0)
    assert "processes_per_host=16 exceeds the 8 GPUs" in error_of(
        RuntimeConfig, instance_type="ml.p4d.24xlarge", processes_per_host=16
    )
    assert "instance_type='ml.nope'" in error_of(RuntimeConfig, instance_type="ml.nope")


def test_for_world_accepts_mapping_model_or_none():
    from_mapping = RuntimeConfig.for_world(4, 2, {"sharded_data_parallel_degree": 2, "sdp_reduce_bucket_size": 5e8})
    assert (from_mapping.instance_count, from_mapping.world_size) == (2, 4)
    assert from_mapping.parameters.sharded_data_parallel_degree == 2
    from_model = RuntimeConfig.for_world(4, 2, SMPParameters(sharded_data_parallel_degree=2))
    assert from_model == from_mapping
    assert RuntimeConfig.for_world(1, 1, None).parameters == SMPParameters()


def test_for_world_errors_name_the_field():
    assert error_of(RuntimeConfig.for_world, 6, 4, None) == (
        "processes_per_host=4 does not divide the world size 6; use 1, 2, 3 or 6"
    )
    assert error_of(RuntimeConfig.for_world, 4, 2, {"sharded_data_parallel_degree": 3}).startswith(
        "parameters.sharded_data_parallel_degree=3 does not divide the data-parallel degree 4; use 1, 2 or 4"
    )
    assert error_of(RuntimeConfig.for_world, 4, 2, {"sharded_data_parallel_degre": 2}).startswith(
        "parameters: unknown key 'sharded_data_parallel_degre' in parameters; did you mean"
    )
    assert error_of(RuntimeConfig.for_world, 0, 1, None).startswith("world_size=0 must be a whole number >= 1")


# ----------------------------------------------------------------------- instance types


def test_instance_table_names_and_shapes():
    assert all(name.startswith("ml.") and t.name == name for name, t in INSTANCE_TYPES.items())
    for name in (
        "ml.p3.2xlarge",
        "ml.p3.8xlarge",
        "ml.p3.16xlarge",
        "ml.p3dn.24xlarge",
        "ml.p4d.24xlarge",
        "ml.p4de.24xlarge",
        "ml.p5.48xlarge",
        "ml.g5.xlarge",
        "ml.g5.48xlarge",
        "ml.g4dn.12xlarge",
        "ml.g4dn.metal",
    ):
        assert INSTANCE_TYPES[name].gpus > 0, name
    for name in ("ml.c5.xlarge", "ml.m5.large", "ml.m5.24xlarge"):
        assert INSTANCE_TYPES[name].gpus == 0, name
    p4d = lookup("ml.p4d.24xlarge")
    assert isinstance(p4d, InstanceType)
    assert (p4d.gpus, p4d.gpu_memory_gib, p4d.gpu_bf16_tflops, p4d.inter_node_gbps) == (8, 40.0, 312.0, 400)
    assert lookup("ml.p3.16xlarge").gpu_bf16_tflops == 0.0  # V100: no bf16
    assert lookup("ml.g5.xlarge").intra_node_gbps == 0.0  # one GPU


def test_lookup_unknown_did_you_mean():
    message = error_of(lookup, "ml.p4d.24xl")
    assert message.startswith("instance_type='ml.p4d.24xl' is not an instance type smsdp knows")
    assert "did you mean 'ml.p4d.24xlarge'?" in message
    assert "use one of" in error_of(lookup, "ml.zzzzzzzzz")

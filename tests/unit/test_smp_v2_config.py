"""SMP v2's keys (``SMP(...)``, or a pasted SDK 2 ``torch_distributed`` distribution): each mapped or refused.

Every key of SMP v2's reference is accepted with the SMP v1 parameter that does the same
here, or refused naming the key; SMP v1 and v2 keys in one dict are refused; the launcher
is torchrun for ``torch_distributed`` and stays mpirun for the SMP v1 configs of the docs.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from smsdp.config import MPIRUN, TORCHRUN, ConfigError, RuntimeConfig, SMPParameters, resolve_job
from smsdp.config.smp_v2 import KEYS
from smsdp.planner import ModelSpec, plan
from tests.sagemaker_docs_examples import docs_p3_distribution, docs_p4d_distribution


def v2_job(parameters: dict, hosts: int = 2, per_host: int = 2):
    """SDK 2's SMP v2 distribution, as the SageMaker docs write it (plus smsdp's processes_per_host)."""
    distribution = {
        "torch_distributed": {"enabled": True, "processes_per_host": per_host},
        "smdistributed": {"modelparallel": {"enabled": True, "parameters": parameters}},
    }
    return resolve_job(distribution, instance_count=hosts)


def error_of(parameters: dict, **shape) -> str:
    with pytest.raises(ConfigError) as info:
        v2_job(parameters, **shape)
    return str(info.value)


@pytest.mark.parametrize(
    ("degree", "expected"),
    [(0, 4), (1, 1), (2, 2), (4, 4)],  # 0: the whole data-parallel group; 1: no sharding; world: every rank
)
def test_hybrid_shard_degree_is_the_shard_group(degree, expected):
    job = v2_job({"hybrid_shard_degree": degree})
    assert job.distribution.launcher == TORCHRUN
    assert job.runtime.parameters.sharded_data_parallel_degree == expected
    assert job.topology.shard_degree == expected and job.topology.replication_degree == 4 // expected
    # The ranks receive the degree, never SMP v2's key: the JSON reads back the same job.
    sent = RuntimeConfig.model_validate_json(job.runtime.to_env_value())
    assert "hybrid_shard_degree" not in job.runtime.to_env_value()
    assert sent.parameters.sharded_data_parallel_degree == expected and sent.topology == job.topology


def test_hybrid_shard_degree_zero_with_tensor_parallelism_is_the_rest_of_the_world():
    job = v2_job({"hybrid_shard_degree": 0, "tensor_parallel_degree": 2})
    p = job.runtime.parameters
    assert (p.tensor_parallel_degree, p.sharded_data_parallel_degree, p.prescaled_batch) == (2, 2, True)


def test_a_hybrid_shard_degree_that_does_not_fit_is_named_as_written():
    message = error_of({"hybrid_shard_degree": 3})
    assert message.startswith("smdistributed.modelparallel.parameters.hybrid_shard_degree=3 does not divide")
    assert "use 1, 2 or 4" in message


def test_every_accepted_key_maps_onto_what_does_the_same_here():
    p = v2_job(
        {
            "hybrid_shard_degree": 2,
            "sm_activation_offloading": True,
            "activation_loading_horizon": 3,
            "tensor_parallel_degree": 1,
            "random_seed": 12345,
            "allow_empty_shards": True,
            "fsdp_cache_flush_warnings": False,
            "context_parallel_degree": 1,
            "expert_parallel_degree": 1,
        }
    ).runtime.parameters
    assert p.sharded_data_parallel_degree == 2
    assert p.offload_activations is True and p.activation_loading_horizon == 3
    assert p.tensor_parallel_seed == 12345
    assert v2_job({"sm_activation_offloading": False}).runtime.parameters.activation_loading_horizon == 2  # v2's
    assert v2_job({"hybrid_shard_degree": 2}).runtime.parameters.tensor_parallel_seed == 12345  # v2's default
    assert v2_job({"random_seed": 7}).runtime.parameters.tensor_parallel_seed == 7
    assert SMPParameters().tensor_parallel_seed == 0  # v1's default unchanged
    assert SMPParameters().activation_loading_horizon == 4  # v1's default unchanged


@pytest.mark.parametrize(
    ("parameters", "starts"),
    [
        ({"context_parallel_degree": 2}, "context_parallel_degree=2 is not supported: smsdp has no context"),
        ({"expert_parallel_degree": 4}, "expert_parallel_degree=4 is not supported: smsdp has no expert"),
        ({"hybrid_shard_degree": -1}, "hybrid_shard_degree=-1 must be a whole number >= 0"),
        ({"hybrid_shard_degree": True}, "hybrid_shard_degree=True must be a whole number >= 0"),
        ({"random_seed": "7"}, "random_seed='7' must be a whole number >= 0"),
        ({"sm_activation_offloading": 1}, "sm_activation_offloading=1 must be True or False"),
        ({"allow_empty_shards": "yes"}, "allow_empty_shards='yes' must be True or False"),
        ({"fsdp_cache_flush_warnings": None}, "fsdp_cache_flush_warnings=None must be True or False"),
        ({"tensor_parallel_degree": 3}, "tensor_parallel_degree=3 does not divide"),
    ],
)
def test_refused_keys_are_named(parameters, starts):
    assert error_of(parameters).startswith("smdistributed.modelparallel.parameters." + starts)


def test_the_table_lists_every_key_of_smp_v2s_reference():
    assert [k.key for k in KEYS] == [
        "hybrid_shard_degree",
        "sm_activation_offloading",
        "activation_loading_horizon",
        "tensor_parallel_degree",
        "random_seed",
        "allow_empty_shards",
        "fsdp_cache_flush_warnings",
        "context_parallel_degree",
        "expert_parallel_degree",
    ]


@pytest.mark.parametrize("v1_key", ["sharded_data_parallel_degree", "ddp", "bf16", "offload_activations"])
def test_smp_v1_and_v2_keys_in_one_config_are_refused(v1_key):
    value = 2 if v1_key == "sharded_data_parallel_degree" else True
    message = error_of({"hybrid_shard_degree": 2, v1_key: value})
    assert f"parameters.{v1_key}={value!r} is an SMP v1 key, and this dict also has SMP v2's" in message
    assert "'hybrid_shard_degree'" in message


def test_the_sdk2_smp_v2_distribution_as_pasted_from_the_docs():
    """SMP v2's documented SDK 2 form: torch_distributed, no mpi, the GPUs of the instance per host."""
    distribution = {
        "torch_distributed": {"enabled": True},
        "smdistributed": {"modelparallel": {"enabled": True, "parameters": {"hybrid_shard_degree": 8}}},
    }
    job = resolve_job(distribution, instance_type="ml.p4d.24xlarge", instance_count=2)
    assert (job.distribution.launcher, job.runtime.processes_per_host) == (TORCHRUN, 8)
    assert job.runtime.parameters.sharded_data_parallel_degree == 8


@pytest.mark.parametrize(
    ("distribution", "starts"),
    [
        ({"torch_distributed": {"enabled": True}, "mpi": {"enabled": True}}, "mpi.enabled=True is enabled beside"),
        ({"torch_distributed": {"enabled": False}}, "torch_distributed.enabled=False (or missing)"),
        ({"torch_distributed": {"enabled": True, "nproc": 2}}, "torch_distributed: unknown key 'nproc'"),
    ],
)
def test_launcher_sections_say_what_to_write(distribution, starts):
    with pytest.raises(ConfigError) as info:
        resolve_job(distribution)
    assert str(info.value).startswith(starts)


def test_the_smp_v1_docs_configs_still_launch_with_mpirun_unchanged():
    for distribution, instance_type, hosts in (
        (docs_p3_distribution(), "ml.p3.16xlarge", 1),
        (docs_p4d_distribution(), "ml.p4d.24xlarge", 8),
    ):
        job = resolve_job(distribution, instance_type=instance_type, instance_count=hosts)
        assert job.distribution.launcher == MPIRUN
        assert job.runtime.parameters.hybrid_shard_degree is None


def test_the_planner_takes_smp_v2_keys():
    model = ModelSpec.gpt(2, 64, 2, 32, 256)
    v2 = plan(model, batch_size=2, instance_count=2, processes_per_host=2, parameters={"hybrid_shard_degree": 0})
    v1 = plan(
        model,
        batch_size=2,
        instance_count=2,
        processes_per_host=2,
        parameters={"sharded_data_parallel_degree": 4, "sdp_param_persistence_threshold": 0},
    )
    assert v2.runtime.parameters.sharded_data_parallel_degree == 4
    assert v2.memory == v1.memory


def test_the_docs_table_is_the_key_table():
    doc = (Path(__file__).resolve().parents[2] / "docs" / "sdk3.md").read_text()
    for key in KEYS:
        assert f"| `{key.key}` | {key.smp_v2} | {key.smsdp} |" in doc, key.key

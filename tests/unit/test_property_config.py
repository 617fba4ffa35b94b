"""Property-based tests over the whole config surface (hypothesis).

Every input is either accepted or rejected with a ``ConfigError`` whose every
problem names the field (a dotted path, or the offending key in the message):
never another exception. Inputs are mostly near-misses of valid configs (the
real keys with valid, borderline and hostile values) plus pure junk, so both
sides of every rule get exercised. ``derandomize=True`` and fixed example
counts keep the run stable and fast in CI; each test asserts how many inputs
it tried and that some were accepted and some rejected.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from smsdp.config import (
    CONFIG_ENV_VAR,
    SCRATCH_BUFFER_ENV_VAR,
    SORT_BUFFER_ENV_VAR,
    ConfigError,
    ConfigProblem,
    Distribution,
    RuntimeConfig,
    SMPParameters,
    resolve_job_config,
)

SETTINGS = dict(
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# --------------------------------------------------------------------------- strategies

#: Text including what breaks naive code: newlines, NUL, shell metacharacters, lone surrogates.
hostile_text = st.one_of(
    st.text(max_size=12),
    st.text(st.characters(categories=("Cs", "Cc", "Zs", "Po", "Sm")), max_size=6),
    st.sampled_from(
        [
            "",
            " ",
            "\n",
            "1\n",
            "auto\n",
            "$(id)",
            "; rm -rf /",
            "../..",
            "\x00",
            "\udcff",
            "5e8",
            "1e6",
            "nan",
            "true",
            "True",
            "-1",
            "0",
            "8192",
        ]
    ),
)
numbers = st.one_of(
    st.integers(-3, 17),
    st.sampled_from([0, 1, 2, 4, 8, 8192, 2**31, 2**63, 10**30, -(10**30)]),
    st.builds(pow, st.just(10), st.just(5000)),  # str() of it raises in Python >= 3.11
    st.floats(allow_nan=True, allow_infinity=True, width=64),
    st.sampled_from([5e8, 1e6, 1.0, 2.0, 0.5, -0.0, 1e308, float("nan"), float("inf")]),
)
scalars = st.one_of(st.none(), st.booleans(), numbers, hostile_text)
junk = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(hostile_text, inner, max_size=3)),
    max_leaves=6,
)
plausible = {
    "sharded_data_parallel_degree": st.sampled_from([1, 2, 4, 8, 3, 0, 2.0]),
    "tensor_parallel_degree": st.sampled_from([1, 2, 4, 3]),
    "ddp": st.booleans(),
    "bf16": st.booleans(),
    "fp16": st.booleans(),
    "prescaled_batch": st.booleans(),
    "sdp_reduce_bucket_size": st.sampled_from([5e8, int(5e8), 1, 0, -1, 2.5]),
    "sdp_param_persistence_threshold": st.sampled_from([1e6, 0, 100]),
    "sdp_max_live_parameters": st.sampled_from([1e9, 1, 0]),
    "sdp_hierarchical_allgather": st.booleans(),
    "sdp_gradient_clipping": st.sampled_from([1.0, 0, 0.5, -1.0, float("nan")]),
    "ddp_dist_backend": st.sampled_from(["auto", "nccl", "gloo", "mpi"]),
    "microbatches": st.sampled_from([1, 2, 4, 0]),
    "pipeline_parallel_degree": st.sampled_from([1, 2]),
    "partitions": st.sampled_from([1, 2]),
    "shard_optimizer_state": st.booleans(),
    "delayed_parameter_initialization": st.booleans(),
    "offload_activations": st.booleans(),
    "activation_loading_horizon": st.sampled_from([4, 0, -1]),
    "placement_strategy": st.sampled_from(["cluster", "spread", "TPD", "XYZ"]),
    "hybrid_shard_degree": st.just(2),  # an SMP v2 key
}
_PLAUSIBLE_KEYS = sorted(k for k in plausible if k != "hybrid_shard_degree")
_OTHER_KEYS = st.one_of(
    st.sampled_from(sorted(SMPParameters._accepted_keys()) + ["hybrid_shard_degree"]),
    hostile_text,
    st.sampled_from(["sharded_degree", "bf_16", "Ddp"]),
)


def _mostly(draw, percent: int, usual, unusual):
    """``usual`` ``percent`` % of the time: inputs near valid ones find the rules' edges."""
    return draw(usual if draw(st.integers(0, 99)) < percent else unusual)


@st.composite
def smp_parameters(draw):
    """Real keys with plausible values, now and then an unknown key or a junk value."""
    params = {}
    for _ in range(draw(st.integers(0, 4))):
        key = _mostly(draw, 90, st.sampled_from(_PLAUSIBLE_KEYS), _OTHER_KEYS)
        strategy = plausible.get(key) if isinstance(key, str) else None
        params[key] = _mostly(draw, 85, strategy, junk) if strategy is not None else draw(junk)
    return params


@st.composite
def distributions(draw):
    if draw(st.integers(0, 19)) == 0:
        return draw(junk)
    dist = {}
    if draw(st.booleans()):
        mp = {
            "enabled": _mostly(draw, 90, st.just(True), scalars),
            "parameters": _mostly(draw, 90, smp_parameters(), junk),
        }
        if draw(st.integers(0, 19)) == 0:
            mp.pop(draw(st.sampled_from(["enabled", "parameters"])))  # a section goes missing
        dist["smdistributed"] = _mostly(
            draw, 90, st.just({"modelparallel": mp}), st.sampled_from([{}, {"dataparallel": {}}])
        )
    if _mostly(draw, 85, st.just(True), st.just(False)):
        dist["mpi"] = {
            "enabled": _mostly(draw, 90, st.just(True), scalars),
            "processes_per_host": _mostly(draw, 85, st.sampled_from([1, 2, 4, 8]), st.one_of(numbers, scalars)),
            "custom_mpi_options": _mostly(
                draw,
                80,
                st.just(""),
                st.one_of(
                    st.sampled_from(
                        [
                            f"-x {SCRATCH_BUFFER_ENV_VAR}=8192",
                            "-x 'unclosed",
                            f"-x {SORT_BUFFER_ENV_VAR}=100",
                            "--mca btl self",
                        ]
                    ),
                    hostile_text,
                ),
            ),
        }
    if draw(st.integers(0, 19)) == 0:
        dist[draw(st.sampled_from(["pytorchddp", "mpii", "smdistributed_"]))] = {}
    return dist


@st.composite
def environments(draw):
    env = {}
    for name in (SCRATCH_BUFFER_ENV_VAR, SORT_BUFFER_ENV_VAR, "OTHER"):
        if draw(st.integers(0, 3)) == 0:
            env[name] = _mostly(
                draw,
                70,
                st.sampled_from(["16777216", "8192", "134217728"]),
                st.one_of(st.sampled_from(["100", "-8192", "0", "1e6", " 8192 ", "x"]), hostile_text),
            )
    return env


@st.composite
def instance_types(draw):
    return _mostly(
        draw,
        85,
        st.just("local"),
        st.one_of(
            st.sampled_from(["ml.p4d.24xlarge", "ml.g5.xlarge", "ml.c5.xlarge", "ml.p4d.24xlarge\n", "ml.nope"]),
            scalars,
        ),
    )


@st.composite
def instance_counts(draw):
    return _mostly(draw, 85, st.sampled_from([1, 2, 4]), st.one_of(numbers, scalars))


# --------------------------------------------------------------------------- checking


@dataclass
class Tally:
    accepted: int = 0
    rejected: int = 0

    @property
    def tried(self) -> int:
        return self.accepted + self.rejected

    def check(self, minimum: int) -> None:
        print(f"{self.tried} inputs: {self.accepted} accepted, {self.rejected} rejected")
        assert self.tried >= minimum and self.accepted > 0 and self.rejected > 0, self


def _keys_in(value) -> set[str]:
    """Every key (as repr) in a nested dict, for 'the message names the field'."""
    found = set()
    if isinstance(value, dict):
        for key, item in value.items():
            found.add(repr(key))
            found |= _keys_in(item)
    return found


def assert_names_fields(error: ConfigError, given) -> None:
    assert error.problems, f"a ConfigError without structured problems: {error}"
    keys = _keys_in(given)
    for problem in error.problems:
        assert isinstance(problem, ConfigProblem)
        named = bool(problem.path) or any(key in problem.rule for key in keys)
        assert named, f"names no field: {problem.render()!r} for {given!r}"
        assert problem.rule.strip(), problem
    assert str(error).strip()


def accepted_or_config_error(tally: Tally, build, given):
    try:
        result = build()
    except ConfigError as exc:  # any other exception fails the test
        assert_names_fields(exc, given)
        tally.rejected += 1
        return None
    tally.accepted += 1
    return result


# --------------------------------------------------------------------------- tests


def test_smp_parameters_accept_or_name_the_field():
    tally = Tally()

    @settings(max_examples=400, **SETTINGS)
    @given(smp_parameters())
    @example({"pipeline_parallel_degree": [10**5000], "partitions": 1})  # found by CI: the conflict's message failed
    @example({"pipeline_parallel_degree": -(10**5000)})
    def run(params):
        result = accepted_or_config_error(tally, lambda: SMPParameters.model_validate(params), params)
        if result is not None:
            assert result.sharded_data_parallel_degree >= 1 and not (result.fp16 and result.bf16)
            # Round trip; SMP v2's hybrid_shard_degree is the client's record only (the ranks get the degree).
            assert SMPParameters.model_validate_json(result.model_dump_json()) == result.model_copy(
                update={"hybrid_shard_degree": None}
            )

    run()
    tally.check(400)


def test_job_configs_accept_or_name_the_field():
    """resolve_job_config: the distribution dict, instance type and count, SMDDP variables, cross-field rules."""
    tally = Tally()

    @settings(max_examples=500, **SETTINGS)
    @given(distributions(), instance_types(), instance_counts(), environments())
    def run(distribution, instance_type, instance_count, environment):
        given_ = {
            "distribution": distribution,
            "instance_type": instance_type,
            "instance_count": instance_count,
            "environment": environment,
        }
        result = accepted_or_config_error(
            tally,
            lambda: resolve_job_config(
                distribution, instance_type=instance_type, instance_count=instance_count, environment=environment
            ),
            given_,
        )
        if result is not None:
            world = result.world_size
            p = result.parameters
            assert world == instance_count * result.processes_per_host
            assert world % (p.tensor_parallel_degree * p.sharded_data_parallel_degree) == 0
            # What the client sends is what every rank reads back.
            assert RuntimeConfig.from_env({CONFIG_ENV_VAR: result.to_env_value()}) == result

    run()
    tally.check(500)


def test_distribution_dicts_accept_or_name_the_field():
    tally = Tally()

    @settings(max_examples=300, **SETTINGS)
    @given(distributions().filter(lambda d: isinstance(d, dict)))  # a non-dict is resolve_job_config's to name
    def run(distribution):
        accepted_or_config_error(
            tally, lambda: Distribution.model_validate(distribution), {"distribution": distribution}
        )

    run()
    tally.check(300)


_HUGE = "<huge>"


def _dumps(value) -> str:
    """JSON of anything ``junk`` makes, a 5,001-digit int included (json.dumps refuses to write it)."""

    def tame(v):
        if isinstance(v, int) and not isinstance(v, bool) and v.bit_length() > 10000:
            return _HUGE
        if isinstance(v, dict):
            return {k: tame(i) for k, i in v.items()}
        return [tame(i) for i in v] if isinstance(v, list) else v

    return json.dumps(tame(value), allow_nan=True, default=str).replace(json.dumps(_HUGE), "1" + "0" * 5000)


config_texts = st.one_of(
    hostile_text,
    junk.map(_dumps),
    st.fixed_dictionaries(
        {},
        optional={
            "parameters": smp_parameters(),
            "instance_type": instance_types(),
            "instance_count": instance_counts(),
            "processes_per_host": instance_counts(),
            "collective_timeout_s": numbers,
            "smddp": st.dictionaries(st.sampled_from(["scratch_bytes", "sort_bytes", "x"]), numbers, max_size=2),
        },
    ).map(_dumps),
)


def test_runtime_config_from_the_environment_accepts_or_names_the_variable():
    """What a rank reads from SMSDP_CONFIG: garbage in the variable is a ConfigError naming it."""
    tally = Tally()

    @settings(max_examples=300, **SETTINGS)
    @given(config_texts)
    def run(text):
        if "\x00" in text or any(0xD800 <= ord(c) <= 0xDFFF for c in text):
            text = text.replace("\x00", "").encode("utf-8", "replace").decode()  # no env var can hold these
        result = accepted_or_config_error(
            tally, lambda: RuntimeConfig.from_env({CONFIG_ENV_VAR: text}), {CONFIG_ENV_VAR: None}
        )
        if result is None:
            return
        assert result.collective_timeout_s > 0 and math.isfinite(result.collective_timeout_s)

    run()
    tally.check(300)


@pytest.mark.parametrize("seconds", [0, -1, float("nan"), float("inf"), True, "600"])
def test_collective_timeout_in_the_runtime_config_must_be_a_positive_number(seconds):
    with pytest.raises(ConfigError) as raised:
        RuntimeConfig(collective_timeout_s=seconds)
    assert "collective_timeout_s" in str(raised.value)

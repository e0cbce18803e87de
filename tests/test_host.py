"""The machine a model was profiled on, told apart from this one."""

from __future__ import annotations

from serving.host import PROFILE_LOAD, PROFILED_ON, Host, OtherLoad, profile_doubts, profiled_elsewhere, this_host


def test_this_machine_is_alike_to_itself_and_a_recorded_difference_is_named() -> None:
    here = this_host()
    assert here.differences(here) == []
    amx = here.model_copy(update={"isa": ["avx2", "avx512f", "amx_int8"], "cores": 16})
    assert here.differences(amx) == [f"cores 16 → {here.cores}", f"isa ['avx2', 'avx512f', 'amx_int8'] → {here.isa}"]


def test_a_model_that_does_not_say_where_it_was_profiled_is_not_judged() -> None:
    assert profiled_elsewhere({}) is None
    assert profiled_elsewhere({PROFILED_ON: this_host().model_dump()}) == []
    gpu = Host(cpu="any", cores=1, isa=[], providers=["CUDAExecutionProvider", "CPUExecutionProvider"])
    assert any(line.startswith("providers ") for line in profiled_elsewhere({PROFILED_ON: gpu.model_dump()}))


def test_a_profile_taken_beside_other_work_is_doubted_and_a_quiet_one_here_is_not() -> None:
    here = {PROFILED_ON: this_host().model_dump()}
    quiet = OtherLoad(seconds=90, cores=2, busy_cores=0.1)
    busy = OtherLoad(seconds=90, cores=2, busy_cores=0.74)
    assert profile_doubts({**here, PROFILE_LOAD: quiet.model_dump()}) == []
    assert profile_doubts({**here, PROFILE_LOAD: busy.model_dump()}) == [
        "it was profiled while other processes kept 0.74 of the machine's 2 cores busy"
    ]

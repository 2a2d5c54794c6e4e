"""The benchmark workloads by name (W1-W18, Wcommits), as `python -m runpool bench --workload`
knows them; each family lives in a module of its own: throughput_workloads (W1, W10),
wakeup_workloads (W2, W3, W9), tenant_workloads (W5, W15), claim_workloads (W6),
checkpoint_workloads (W7, W8), agent_workloads and turn_cost (W11), live_workloads (W12,
W13), host_workloads (W1p, W16, Wcommits), ops_workloads (W17), schedule_workloads (W18);
W14 is wait_bench's, added by bench."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

from .agent_workloads import w11_agent_load
from .checkpoint_workloads import w7_checkpoint_cost, w8_resume_cost
from .claim_workloads import w6_claim_cost, w6_claim_depth
from .host_workloads import w1p_pooler, w16_many_claimers, wcommits
from .live_workloads import w12_follow_latency, w13_progress_cost
from .ops_workloads import w17_purge
from .schedule_workloads import w18_schedule_lateness, w18_schedule_storm
from .tenant_workloads import w5_fairness, w15_rate_limit
from .throughput_workloads import w1_throughput, w10_serial_keys
from .turn_cost import w11_turn_cost
from .wakeup_workloads import w2_latency, w3_idle, w9_cancel_latency

__all__ = ["WORKLOADS"]


WORKLOADS: Final[dict[str, Callable[[str], dict[str, Any]]]] = {
    "W1": w1_throughput,
    "W1q": lambda server: w1_throughput(server, quotas=True),
    "W1w1": lambda server: w1_throughput(server, workers=1),
    "W1w4": lambda server: w1_throughput(server, workers=4),
    "W2": w2_latency,
    "W3": w3_idle,
    "W5": w5_fairness,
    "W6": w6_claim_depth,
    "W6cost": w6_claim_cost,
    "W7": w7_checkpoint_cost,
    "W8": w8_resume_cost,
    "W9": w9_cancel_latency,
    "W10": w10_serial_keys,
    "W11": w11_agent_load,
    "W11x500": lambda server: {**w11_agent_load(server, slots=500), "workload": "W11x500"},
    "W11x2000": lambda server: {**w11_agent_load(server, slots=2000), "workload": "W11x2000"},
    "W11cpu": w11_turn_cost,
    # Stateless sessions, as behind a pooler: the batches call functions, or (the fallback)
    # go as psycopg's pipeline of the statements.
    "W11cpup": lambda server: w11_turn_cost(server, via="functions"),
    "W11cpus": lambda server: w11_turn_cost(server, via="pipeline"),
    "W12": w12_follow_latency,
    "W13": w13_progress_cost,
    "W15": w15_rate_limit,
    "W1p": w1p_pooler,
    "W16": w16_many_claimers,
    "W16t": lambda server: w16_many_claimers(server, tenants=16),
    "Wcommits": wcommits,
    "W17": w17_purge,
    "W18": w18_schedule_lateness,
    "W18x1000": w18_schedule_storm,
}

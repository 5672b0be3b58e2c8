"""A multi-tenant, multi-turn chat workload with a fixed seed.

Each tenant has its own ``cache_salt`` and a system prompt shared by its clients; every
other tenant serves through a LoRA-like adapter (``extra_key``). Turn ``r`` of a client's
conversation is: system prompt + (user text + answer) of earlier turns + new user text.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pd_cache.core.fields import check_non_negative, check_positive_int


@dataclass(frozen=True)
class WorkloadConfig:
    tenants: int = 4
    clients_per_tenant: int = 2
    system_tokens: int = 1024
    rounds: int = 4
    user_tokens: int = 256
    output_tokens: int = 32
    vocab_size: int = 4096
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("tenants", "clients_per_tenant", "rounds", "user_tokens", "vocab_size"):
            check_positive_int(f"workload.{name}", getattr(self, name))
        for name in ("system_tokens", "output_tokens"):
            check_non_negative(f"workload.{name}", getattr(self, name))


@dataclass(frozen=True)
class Conversation:
    tenant: int
    client: int
    extra_key: str | None
    cache_salt: str
    system: tuple[int, ...]
    user_turns: tuple[tuple[int, ...], ...]

    @property
    def name(self) -> str:
        return f"t{self.tenant}c{self.client}"

    def prompt(self, round_index: int, answers: list[list[int]]) -> list[int]:
        """The prompt of turn ``round_index`` given the answers of the earlier turns."""
        if len(answers) != round_index:
            raise ValueError(f"answers: need {round_index} earlier answers, got {len(answers)}")
        tokens = list(self.system)
        for user, answer in zip(self.user_turns, answers):
            tokens += list(user) + answer
        return tokens + list(self.user_turns[round_index])


def make_conversations(cfg: WorkloadConfig) -> list[Conversation]:
    rng = np.random.default_rng(cfg.seed)
    conversations = []
    for tenant in range(cfg.tenants):
        system = tuple(rng.integers(0, cfg.vocab_size, cfg.system_tokens).tolist())
        extra_key = f"adapter-{tenant}" if tenant % 2 else None
        for client in range(cfg.clients_per_tenant):
            turns = tuple(tuple(rng.integers(0, cfg.vocab_size, cfg.user_tokens).tolist())
                          for _ in range(cfg.rounds))
            conversations.append(Conversation(tenant, client, extra_key, f"tenant-{tenant}",
                                              system, turns))
    return conversations

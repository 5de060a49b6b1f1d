"""The prefix cache: its interface and statistics (``base``), the radix tree it keeps
(``radix_tree``, its nodes ``tree_node``), one implementation per way a runner keeps KV
(``slot_cache`` for per-slot streams, recorded in ``slot_streams``; ``paged_cache`` for a
paged pool whose block tables are ``block_table`` and whose nodes' blocks are ``block_span``,
with recurrent-state snapshots for models that need them (``state_snapshots``)), the saved
states behind either (``saved_state``) in host RAM (``host_tier``, its figures
``tier_figures``) and on disk (``disk_tier``, its directory ``state_directory``, its files
``state_file``), and the one choice between them, made once at start-up
(:func:`build_prefix_cache`)."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from slotserve.engine.chunk_policy import ChunkPolicy
from slotserve.engine.config import EngineConfig
from slotserve.engine.prefix_cache.base import NullPrefixCache, PrefixCache
from slotserve.engine.prefix_cache.host_tier import HostTier
from slotserve.engine.prefix_cache.paged_cache import PagedPrefixCache
from slotserve.engine.prefix_cache.runner_kv import SavableKvStore, SavablePagedKv
from slotserve.engine.prefix_cache.slot_cache import SlotPrefixCache
from slotserve.engine.prefix_cache.state_snapshots import SnapshotBook
from slotserve.engine.runner_interface import ModelInfo, Runner, StateSnapshots

logger = logging.getLogger(__name__)

# llama-server's --cache-ram default: the most host RAM the tier takes unless told otherwise.
DEFAULT_HOST_RAM_CAP = 8 * 2**30
DEFAULT_DISK_CAP = 64 * 2**30


def build_prefix_cache(runner: Runner, config: EngineConfig) -> PrefixCache:
    """The cache for this runner and configuration, or the null cache with the reason (logged
    when the model, not the configuration, rules it out)."""
    info: ModelInfo = runner.model_info
    if not config.prefix_cache:
        return NullPrefixCache(
            runner, config.num_slots, "disabled by configuration (--no-prefix-cache)"
        )
    if info.prefix_cache_unsupported is not None:
        logger.warning("prefix cache disabled: %s", info.prefix_cache_unsupported)
        return NullPrefixCache(runner, config.num_slots, info.prefix_cache_unsupported)
    paged = runner.paged_kv
    # Default budget: everything the KV memory can hold (paged), or what free slots can.
    budget = info.kv_capacity if paged is not None else config.num_slots * info.max_seq_len
    if config.prefix_cache_budget_tokens is not None:
        budget = min(budget, config.prefix_cache_budget_tokens)
    if config.prefix_cache_budget_bytes is not None and info.kv_bytes_per_token > 0:
        budget = min(budget, config.prefix_cache_budget_bytes // info.kv_bytes_per_token)
    logger.info(
        "prefix cache on (%s): budget %d tokens (%.1f MiB of KV)",
        "KV blocks held by the radix tree" if paged is not None else "KV kept in free slots",
        budget,
        budget * info.kv_bytes_per_token / 2**20,
    )
    policy: ChunkPolicy = info.chunk_policy
    book = None
    if isinstance(runner, StateSnapshots) and runner.snapshot_capacity > 0:
        book = SnapshotBook(runner, config.prefix_cache_snapshot_interval, policy.grain)
        logger.info(
            "prefix cache keeps up to %d recurrent-state snapshots (%.1f MiB each, %.0f MiB "
            "in all): at each prompt's end, where it branches, and every %d tokens",
            book.capacity,
            book.bytes_each / 2**20,
            book.capacity * book.bytes_each / 2**20,
            book.interval,
        )
    if paged is not None:
        # Saved states hold one rank's KV and no recurrent state: neither kind of model gets
        # the tiers.
        host = None
        if isinstance(runner, SavablePagedKv) and info.tensor_parallel_size == 1 and book is None:
            host = _host_tier(runner, config)
        return PagedPrefixCache(
            runner,
            paged,
            config.num_slots,
            policy,
            budget,
            info.kv_bytes_per_token,
            book,
            host,
        )
    host = None
    if isinstance(runner, SavableKvStore) and book is None:  # states hold no recurrent state
        host = _host_tier(runner, config)
    return SlotPrefixCache(
        runner, config.num_slots, policy, budget, info.kv_bytes_per_token, host, book
    )


def _host_tier(runner: SavableKvStore | SavablePagedKv, config: EngineConfig) -> HostTier | None:
    ram = config.prefix_cache_ram
    if ram is None:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        ram = min(DEFAULT_HOST_RAM_CAP, free // 4)
    directory = config.prefix_cache_dir
    if ram == 0:
        if directory is not None:
            logger.warning(
                "--prefix-cache-dir is ignored: its states pass through RAM, and "
                "--prefix-cache-ram is 0"
            )
        return None
    logger.info("prefix cache host-RAM tier: up to %.1f MiB", ram / 2**20)
    if directory is None:
        return HostTier(ram)
    disk_budget = config.prefix_cache_dir_size
    if disk_budget is None:
        try:
            Path(directory).mkdir(parents=True, exist_ok=True)
            disk_budget = min(DEFAULT_DISK_CAP, shutil.disk_usage(directory).free // 4)
        except OSError as exc:
            logger.warning("prefix cache disk tier off: %s is not usable (%s)", directory, exc)
            return HostTier(ram)
    tier = HostTier(ram, Path(directory), runner.kv_fingerprint(), disk_budget)
    assert tier.disk is not None
    logger.info(
        "prefix cache disk tier in %s: up to %.1f GiB, %d states found",
        directory,
        disk_budget / 2**30,
        len(tier.disk),
    )
    return tier

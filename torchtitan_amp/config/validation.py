"""Checks of single fields and of combinations that need no world size (those that do belong to
`job.resolve_job`). Each field's type and allowed set were checked as it was set."""

from __future__ import annotations

from torchtitan_amp.config.sections import JobConfig
from torchtitan_amp.core.errors import ConfigError
from torchtitan_amp.core.rules import flavor_names
from torchtitan_amp.observability.trackers import WANDB_PROJECT_FORBIDDEN, wandb_missing


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def validate(config: JobConfig) -> None:
    t, o, p, lr = config.training, config.optimizer, config.parallelism, config.lr_scheduler
    m = config.model
    # Each field alone was checked as it was set; a flavour must also belong to the chosen family.
    own = flavor_names(m.name)
    _require(m.flavor in own, f"'model.flavor' = {m.flavor!r} is not a flavour of model.name = {m.name!r}; "
             f"choose one of: {', '.join(repr(f) for f in own)}")
    _require(t.seq_len >= 2, f"'training.seq_len' must be >= 2, got {t.seq_len}")
    _require(t.local_batch_size >= 1, f"'training.local_batch_size' must be >= 1, got {t.local_batch_size}")
    _require(t.dataloader_num_workers >= 0,
             f"'training.dataloader_num_workers' must be >= 0, got {t.dataloader_num_workers}")
    _require(
        t.global_batch_size == -1 or t.global_batch_size >= 1,
        f"'training.global_batch_size' must be -1 or >= 1, got {t.global_batch_size}",
    )
    _require(t.steps >= 1, f"'training.steps' must be >= 1, got {t.steps}")
    _require(t.gc_freq >= 0, f"'training.gc_freq' must be >= 0, got {t.gc_freq}")
    _require(o.lr > 0, f"'optimizer.lr' must be > 0, got {o.lr}")
    _require(0 <= o.beta1 < 1 and 0 <= o.beta2 < 1, "'optimizer.beta1/beta2' must be in [0, 1)")
    _require(o.eps > 0, f"'optimizer.eps' must be > 0, got {o.eps}")
    _require(o.weight_decay >= 0, f"'optimizer.weight_decay' must be >= 0, got {o.weight_decay}")
    _require(lr.warmup_steps >= 0, f"'lr_scheduler.warmup_steps' must be >= 0, got {lr.warmup_steps}")
    _require(
        lr.decay_ratio == -1.0 or 0.0 <= lr.decay_ratio <= 1.0,
        f"'lr_scheduler.decay_ratio' must be -1 or in [0, 1], got {lr.decay_ratio}",
    )
    _require(
        0.0 <= lr.min_lr_factor <= 1.0,
        f"'lr_scheduler.min_lr_factor' must be in [0, 1], got {lr.min_lr_factor}",
    )
    for name in ("data_parallel_replicate_degree", "tensor_parallel_degree", "pipeline_parallel_degree",
                 "context_parallel_degree", "expert_parallel_degree"):
        value = getattr(p, name)
        _require(value >= 1, f"'parallelism.{name}' must be >= 1, got {value}")
    _require(
        p.data_parallel_shard_degree == -1 or p.data_parallel_shard_degree >= 1,
        f"'parallelism.data_parallel_shard_degree' must be -1 or >= 1, got {p.data_parallel_shard_degree}",
    )
    _require(p.ddp_bucket_cap_mb > 0, f"'parallelism.ddp_bucket_cap_mb' must be > 0, got {p.ddp_bucket_cap_mb}")
    _require(
        p.pipeline_parallel_microbatch_size >= 1,
        "'parallelism.pipeline_parallel_microbatch_size' must be >= 1",
    )
    _validate_metrics(config)
    v = config.validation
    _require(v.freq >= 1, f"'validation.freq' must be >= 1, got {v.freq}")
    _require(v.steps == -1 or v.steps >= 1, f"'validation.steps' must be -1 (the whole split) or >= 1, got {v.steps}")
    _require(v.local_batch_size >= 0,
             f"'validation.local_batch_size' must be >= 1, or 0 for training's, got {v.local_batch_size}")
    _require(v.seq_len == 0 or v.seq_len >= 2, f"'validation.seq_len' must be >= 2, or 0 for training's, got {v.seq_len}")
    _validate_samples(config)
    for name in ("init_timeout_seconds", "timeout_seconds"):
        value = getattr(config.comm, name)
        _require(value >= 1, f"'comm.{name}' must be >= 1, got {value}")
    _require(config.checkpoint.interval >= 1, "'checkpoint.interval' must be >= 1")
    _require(config.checkpoint.keep_latest_k >= 0, "'checkpoint.keep_latest_k' must be >= 0")
    _require(config.checkpoint.preemption_warning_s >= 0,
             f"'checkpoint.preemption_warning_s' must be >= 0 (0: unknown), got {config.checkpoint.preemption_warning_s}")
    _require(config.checkpoint.load_step >= -1, "'checkpoint.load_step' must be -1 (newest) or a step >= 0")
    _require(config.checkpoint.enable or not config.checkpoint.last_save_hf,
             "'checkpoint.last_save_hf' converts the last checkpoint: it needs checkpoint.enable = true")
    _require(t.fault_inject_at_step >= 0, "'training.fault_inject_at_step' must be >= 0 (0: off)")
    ac = config.activation_checkpoint
    _require(
        ac.mode != "selective" or ac.selective_ac_option == "op" or ac.selective_ac_option.isdigit()
        and int(ac.selective_ac_option) >= 1,
        f"'activation_checkpoint.selective_ac_option' must be a positive integer or 'op', "
        f"got {ac.selective_ac_option!r}",
    )
    dr = config.dry_run
    _require(dr.world_size == -1 or dr.world_size >= 1,
             f"'dry_run.world_size' must be -1 or >= 1, got {dr.world_size}")
    _require(dr.rank >= 0, f"'dry_run.rank' must be >= 0, got {dr.rank}")
    _require(dr.vocab_size >= 0, f"'dry_run.vocab_size' must be >= 0 (0: the tokenizer's), got {dr.vocab_size}")
    _validate_mixed_precision(config)
    _require(not (config.mixed_precision.audit and config.compile.enable),
             "'mixed_precision.audit' records the eager model's ops; set compile.enable = false for the audit")


def _validate_metrics(config: JobConfig) -> None:
    m = config.metrics
    _require(m.log_freq >= 1, f"'metrics.log_freq' must be >= 1, got {m.log_freq}")
    # W&B's own limits, refused here rather than by wandb.init after the model is built.
    bad = set(WANDB_PROJECT_FORBIDDEN) & set(m.wandb_project)
    _require(not bad and len(m.wandb_project) <= 128,
             f"'metrics.wandb_project' = {m.wandb_project!r}: at most 128 characters, none of "
             f"{' '.join(WANDB_PROJECT_FORBIDDEN)}")
    for tag in m.wandb_tags:
        _require(0 < len(tag) <= 64, f"'metrics.wandb_tags': each tag must be 1-64 characters, got {tag!r}")
    missing = wandb_missing() if m.enable_wandb else None
    _require(missing is None, missing or "")


def _validate_samples(config: JobConfig) -> None:
    v = config.validation
    _require(not v.sample_prompts or v.enable,
             "'validation.sample_prompts' are generated at every evaluation: set validation.enable = true")
    _require(v.sample_max_new_tokens >= 1, f"'validation.sample_max_new_tokens' must be >= 1, got {v.sample_max_new_tokens}")
    _require(v.sample_temperature >= 0,
             f"'validation.sample_temperature' must be >= 0 (0: greedy), got {v.sample_temperature}")


def _validate_mixed_precision(config: JobConfig) -> None:
    mp = config.mixed_precision
    _require(mp.init_scale > 0, f"'mixed_precision.init_scale' must be > 0, got {mp.init_scale}")
    _require(mp.growth_factor > 1.0, f"'mixed_precision.growth_factor' must be > 1, got {mp.growth_factor}")
    _require(
        0.0 < mp.backoff_factor < 1.0,
        f"'mixed_precision.backoff_factor' must be in (0, 1), got {mp.backoff_factor}",
    )
    _require(mp.growth_interval >= 1, "'mixed_precision.growth_interval' must be >= 1")
    # Importability of lower_precision_safe_modules is checked by the precision plan, which owns
    # the meaning of those names; dtype combinations are checked there too.

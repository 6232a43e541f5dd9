"""TRL 1.12.0's PPO configuration and constructor, vendored as data (``trl.experimental.ppo``; TRL 1.13 dropped it).

Each field row is ``(name, type, repr(default))`` as ``dataclasses.fields`` gives them (``"<required>"``: no
default). ``PPO_CONFIG_FIELDS`` are the fields ``PPOConfig`` declares itself (``trl/experimental/ppo/ppo_config.py``),
``BASE_CONFIG_FIELDS`` those TRL's ``_BaseConfig`` overrides on ``transformers.TrainingArguments``
(``trl/trainer/base_config.py``); every other ``TrainingArguments`` field is inherited from the installed transformers
(5.24.0 in the parity runs). ``MODEL_CONFIG_FIELDS`` / ``SCRIPT_ARGUMENTS_FIELDS`` are the names of TRL 1.12's
``ModelConfig`` and ``ScriptArguments``, which its ``examples/scripts/ppo/ppo_tldr.py`` parses beside ``PPOConfig``.
``PPO_TRAINER_INIT`` is ``PPOTrainer.__init__``'s signature, ``ARGS_READ`` every ``args.<name>`` the trainer module
reads (a regex over ``ppo_trainer.py``; the ``transformers.Trainer`` methods it calls read more: the optimizer's
``learning_rate``, ``weight_decay``, ``optim``, ``adam_*``, the schedule's ``lr_scheduler_type``, ``warmup_steps``,
``lr_scheduler_kwargs``). Several PPOConfig fields are outputs, overwritten by the trainer: ``world_size``,
``local_batch_size``, ``micro_batch_size``, ``batch_size``, ``mini_batch_size``, ``local_mini_batch_size``,
``num_total_batches`` (and ``total_episodes`` when None). ``sft_model_path`` / ``reward_model_path`` are read by
TRL's example scripts only.

tests/test_ppo_math.py checks these tables against the real TRL 1.12.0 when ``.venv-trl112`` exists.
"""

TRL_VERSION = "1.12.0"

PPO_CONFIG_FIELDS: tuple[tuple[str, str, str], ...] = (
    ('learning_rate', 'float', '3e-06'),
    ('push_to_hub', 'bool', 'False'),
    ('dataset_num_proc', 'int | None', 'None'),
    ('num_mini_batches', 'int', '1'),
    ('total_episodes', 'int | None', 'None'),
    ('local_rollout_forward_batch_size', 'int', '64'),
    ('num_sample_generations', 'int', '10'),
    ('response_length', 'int', '53'),
    ('stop_token', "Optional[Literal['eos']]", 'None'),
    ('stop_token_id', 'int | None', 'None'),
    ('temperature', 'float', '0.7'),
    ('missing_eos_penalty', 'float | None', 'None'),
    ('sft_model_path', 'str', "'EleutherAI/pythia-160m'"),
    ('world_size', 'int | None', 'None'),
    ('num_total_batches', 'int | None', 'None'),
    ('micro_batch_size', 'int | None', 'None'),
    ('local_batch_size', 'int | None', 'None'),
    ('batch_size', 'int | None', 'None'),
    ('local_mini_batch_size', 'int | None', 'None'),
    ('mini_batch_size', 'int | None', 'None'),
    ('reward_model_path', 'str', "'EleutherAI/pythia-160m'"),
    ('model_adapter_name', 'str | None', 'None'),
    ('ref_adapter_name', 'str | None', 'None'),
    ('num_ppo_epochs', 'int', '4'),
    ('whiten_rewards', 'bool', 'False'),
    ('kl_coef', 'float', '0.05'),
    ('kl_estimator', "Literal['k1', 'k3']", "'k1'"),
    ('cliprange', 'float', '0.2'),
    ('vf_coef', 'float', '0.1'),
    ('cliprange_value', 'float', '0.2'),
    ('gamma', 'float', '1.0'),
    ('lam', 'float', '0.95'),
    ('ds3_gather_for_generation', 'bool', 'True'),
)

BASE_CONFIG_FIELDS: tuple[tuple[str, str, str], ...] = (
    ('lr_scheduler_kwargs', 'dict | str | None', 'None'),
    ('bf16', 'bool | None', 'None'),
    ('gradient_checkpointing', 'bool', 'True'),
    ('use_liger_kernel', 'bool', 'False'),
    ('torch_empty_cache_steps', 'int | None', 'None'),
    ('logging_steps', 'float', '10'),
)

MODEL_CONFIG_FIELDS: tuple[str, ...] = (
    'model_name_or_path', 'model_revision', 'dtype', 'attn_implementation', 'use_peft', 'lora_r', 'lora_alpha',
    'lora_dropout', 'lora_target_modules', 'lora_target_parameters', 'lora_modules_to_save', 'lora_task_type',
    'use_rslora', 'use_dora', 'load_in_8bit', 'load_in_4bit', 'bnb_4bit_quant_type', 'use_bnb_nested_quant',
    'bnb_4bit_quant_storage',
)

SCRIPT_ARGUMENTS_FIELDS: tuple[str, ...] = (
    'dataset_name', 'dataset_config', 'dataset_train_split', 'dataset_test_split', 'dataset_streaming',
    'ignore_bias_buffers',
)

PPO_TRAINER_INIT: tuple[tuple[str, str, str], ...] = (
    ('args', 'PPOConfig', '<required>'),
    (
        'processing_class',
        'PreTrainedTokenizerBase | BaseImageProcessor | FeatureExtractionMixin | ProcessorMixin',
        '<required>',
    ),
    ('model', 'PreTrainedModel', '<required>'),
    ('ref_model', 'PreTrainedModel | None', '<required>'),
    ('reward_model', 'PreTrainedModel', '<required>'),
    ('train_dataset', 'Dataset', '<required>'),
    ('value_model', 'PreTrainedModel', '<required>'),
    ('data_collator', 'DataCollatorWithPadding | None', 'None'),
    ('eval_dataset', 'Dataset | dict[str, Dataset] | None', 'None'),
    ('optimizers', 'tuple[Optimizer, LambdaLR]', '(None, None)'),
    ('callbacks', 'list[TrainerCallback] | None', 'None'),
    ('peft_config', 'PeftConfig | None', 'None'),
)

ARGS_READ: tuple[str, ...] = (
    'batch_size',
    'bf16',
    'cliprange',
    'cliprange_value',
    'disable_tqdm',
    'ds3_gather_for_generation',
    'eval_steps',
    'gamma',
    'gradient_accumulation_steps',
    'gradient_checkpointing',
    'gradient_checkpointing_kwargs',
    'hub_model_id',
    'kl_coef',
    'kl_estimator',
    'lam',
    'local_batch_size',
    'local_mini_batch_size',
    'local_rollout_forward_batch_size',
    'logging_steps',
    'micro_batch_size',
    'mini_batch_size',
    'missing_eos_penalty',
    'model_adapter_name',
    'num_mini_batches',
    'num_ppo_epochs',
    'num_sample_generations',
    'num_total_batches',
    'num_train_epochs',
    'output_dir',
    'per_device_eval_batch_size',
    'per_device_train_batch_size',
    'push_to_hub',
    'ref_adapter_name',
    'report_to',
    'response_length',
    'save_steps',
    'seed',
    'should_save',
    'stop_token',
    'stop_token_id',
    'temperature',
    'total_episodes',
    'vf_coef',
    'whiten_rewards',
    'world_size',
)

"""The step plan against real CPU steps, one tiny config per architecture family.

Each case builds the same tiny config twice: on the meta device for `plan_step_memory`, and for
real, prepared by a real `Trainer` (its `__init__` sets `config.use_cache = args.use_cache`) and
stepped as the Trainer steps it (the batch a collator makes, with its all-ones attention mask;
`num_items_in_batch` where the model takes loss keyword arguments; backward; clipping; the
Trainer's own optimizer from `create_optimizer()`; `zero_grad`). Two figures are compared:

- the activations: the storages autograd saved for backward during the real forward and still
  saved when it returns, counted independently of the library's counter
  (`helpers.independent_saved_bytes(alive_at_end=True)`, a plain `saved_tensors_hooks` walk, the
  parameters' storages left out): equal to the byte;
- the peak: the profiler's live bytes during a later real step (after a first one made the
  optimizer state), plus what was alive before it: within 64 bytes (a few 0-dim scalars that C++
  makes without the dispatcher, invisible to a fake trace), except where a row says why.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Tuple

import pytest
import torch

from helpers import independent_saved_bytes, installed_version, real_step_peak
from trainer_memcb.plan.answers.step_memory import plan_step_memory

transformers = pytest.importorskip("transformers")

# The rows transformers 4.57 (the oldest supported) cannot plan, each with where its forward reads
# a value that a fake tensor has not (tried on 4.57.1; transformers 5 reads none of them). The
# other rows run on 4.57 too, where the Trainer leaves `use_cache` as the config has it.
_LAYERDROP = ("transformers 4.x draws LayerDrop's number per layer in training (`torch.rand([]) < "
              "self.layerdrop`, read even at layerdrop 0): a value a fake tensor has not")
_MOE_LOOP = ("transformers 4.x runs the experts in a loop over `expert_mask.sum(...).nonzero()` "
             "(modeling_{}.py): an output shape a fake tensor cannot know; 5 runs them grouped")
OLDER_TRANSFORMERS_CANNOT = {
    "opt": _LAYERDROP + " (modeling_opt.py)",
    "bart": _LAYERDROP + " (modeling_bart.py)",
    "whisper": _LAYERDROP + " (modeling_whisper.py)",
    "mixtral": _MOE_LOOP.format("mixtral"),
    "qwen3-moe": _MOE_LOOP.format("qwen3_moe"),
    "llava": ("transformers 4.x checks the image tokens by `inputs_embeds[special_image_mask].numel()` "
              "(modeling_llava.py): a boolean index, whose size a fake tensor cannot know"),
}

B, S, T = 2, 24, 12  # batch, tokens, a seq2seq model's target tokens
V = 128

# One tiny config per family: (model class, config class, attention, config keywords).
FAMILIES: Dict[str, Tuple[str, str, str, Dict[str, Any]]] = {
    "gpt2": ("GPT2LMHeadModel", "GPT2Config", "sdpa", dict(n_embd=32, n_layer=2, n_head=4, n_positions=64, vocab_size=V)),
    "opt": ("OPTForCausalLM", "OPTConfig", "sdpa", dict(hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
                                                          max_position_embeddings=64, vocab_size=V, word_embed_proj_dim=32)),
    "mistral": ("MistralForCausalLM", "MistralConfig", "sdpa", dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, vocab_size=V, max_position_embeddings=64, sliding_window=16)),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", "sdpa", dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, vocab_size=V, max_position_embeddings=64)),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", "sdpa", dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=V, max_position_embeddings=64)),
    "gemma2": ("Gemma2ForCausalLM", "Gemma2Config", "eager", dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=V, max_position_embeddings=64,
               sliding_window=16)),
    "gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig", "eager", dict(hidden_size=32, intermediate_size=64,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=V,
               max_position_embeddings=64, sliding_window=16)),
    "modernbert": ("ModernBertForMaskedLM", "ModernBertConfig", "sdpa", dict(hidden_size=32, intermediate_size=64,
                   num_hidden_layers=2, num_attention_heads=4, vocab_size=V, max_position_embeddings=64, pad_token_id=0,
                   bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2)),
    "roberta-cls": ("RobertaForSequenceClassification", "RobertaConfig", "sdpa", dict(hidden_size=32, intermediate_size=64,
                    num_hidden_layers=2, num_attention_heads=4, vocab_size=V, max_position_embeddings=72, num_labels=3)),
    "gpt-neox": ("GPTNeoXForCausalLM", "GPTNeoXConfig", "sdpa", dict(hidden_size=32, intermediate_size=64,
                 num_hidden_layers=2, num_attention_heads=4, vocab_size=V, max_position_embeddings=64)),
    "phi3": ("Phi3ForCausalLM", "Phi3Config", "sdpa", dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=4, vocab_size=V, max_position_embeddings=64, pad_token_id=0,
             eos_token_id=2, bos_token_id=1)),
    "bart": ("BartForConditionalGeneration", "BartConfig", "sdpa", dict(d_model=32, encoder_ffn_dim=64, decoder_ffn_dim=64,
             encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4, vocab_size=V,
             max_position_embeddings=64)),
    "t5": ("T5ForConditionalGeneration", "T5Config", "eager", dict(d_model=32, d_ff=64, d_kv=8, num_layers=2,
           num_decoder_layers=2, num_heads=4, vocab_size=V, decoder_start_token_id=0)),
    "vit": ("ViTForImageClassification", "ViTConfig", "sdpa", dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, image_size=32, patch_size=8, num_labels=3)),
    "whisper": ("WhisperForConditionalGeneration", "WhisperConfig", "sdpa", dict(d_model=32, encoder_ffn_dim=64,
                decoder_ffn_dim=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                decoder_attention_heads=4, vocab_size=V, num_mel_bins=8, max_source_positions=16,
                max_target_positions=32, decoder_start_token_id=1, pad_token_id=0)),
    "mixtral": ("MixtralForCausalLM", "MixtralConfig", "sdpa", dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, vocab_size=V, max_position_embeddings=64,
                num_local_experts=4, num_experts_per_tok=2)),
    "qwen3-moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", "sdpa", dict(hidden_size=32, intermediate_size=64,
                  moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  vocab_size=V, max_position_embeddings=64, num_experts=4, num_experts_per_tok=2)),
    # A Llava: a CLIP vision tower of (32 / 8)^2 patches, a Llama; 16 image tokens in each row's text.
    "llava": ("LlavaForConditionalGeneration", "LlavaConfig", "sdpa", dict(
              vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64,
                                 num_hidden_layers=2, num_attention_heads=4, image_size=32, patch_size=8,
                                 projection_dim=32),
              text_config=dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, vocab_size=V, max_position_embeddings=64),
              image_token_id=V - 1)),
    "llama": ("LlamaForCausalLM", "LlamaConfig", "sdpa", dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, vocab_size=V, max_position_embeddings=64)),
}


def make_config(kind: str, attn: str = None) -> Any:
    _, config_class, default_attn, keywords = FAMILIES[kind]
    config = getattr(transformers, config_class)(**keywords)
    config._attn_implementation = attn or default_attn
    return config


def model_class(kind: str) -> Any:
    return getattr(transformers, FAMILIES[kind][0])


def meta_builder(kind: str, attn: str = None, lora: bool = False) -> Callable[[], torch.nn.Module]:
    def build() -> torch.nn.Module:
        with torch.device("meta"):
            model = model_class(kind)(make_config(kind, attn))
        if lora:
            from trainer_memcb.plan.model.lora import add_lora_adapters

            model = add_lora_adapters(model, 4, ["q_proj", "v_proj"])
        return model

    return build


def real_trainer(kind: str, dtype: torch.dtype, attn: str = None, ckpt: bool = False, lora: bool = False) -> Any:
    """A real model prepared by a real Trainer's `__init__`, with the Trainer's own optimizer."""
    from helpers import scratch_folder, training_args

    torch.manual_seed(0)
    model = model_class(kind)(make_config(kind, attn)).to(dtype)
    if lora:
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    trainer = transformers.Trainer(model=model, args=training_args(scratch_folder("unused-output"), optim="adamw_torch"))
    if ckpt:  # as Trainer.train() turns it on: activation_checkpointing_kwargs None
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=None)
        else:  # transformers 4.x, as its Trainer calls it: gradient_checkpointing_kwargs None (reentrant)
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=None)
    model.train()
    trainer.create_optimizer()
    return trainer


def collated_batch(kind: str, model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """The batch a collator makes for the family's head (values random; masks all ones)."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 100, (B, S), generator=generator)
    mask = torch.ones(B, S, dtype=torch.long)
    floating = next(p.dtype for p in model.parameters() if p.is_floating_point())
    if kind == "vit":
        return {"pixel_values": torch.randn(B, 3, 32, 32, generator=generator).to(floating),
                "labels": torch.zeros(B, dtype=torch.long)}
    if kind == "whisper":
        return {"input_features": torch.randn(B, 8, 32, generator=generator).to(floating),
                "labels": torch.randint(3, 100, (B, T), generator=generator)}
    if kind in ("bart", "t5"):  # DataCollatorForSeq2Seq(model=model)
        labels = torch.randint(3, 100, (B, T), generator=generator)
        return {"input_ids": ids, "attention_mask": mask, "labels": labels,
                "decoder_input_ids": model.prepare_decoder_input_ids_from_labels(labels=labels)}
    if kind == "llava":  # LlavaProcessor's "USER: <image>..." ids: BOS, 16 image tokens, text
        ids[:, 1:17] = V - 1
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.clone(),
                "pixel_values": torch.randn(B, 3, 32, 32, generator=generator).to(floating)}
    if kind == "roberta-cls":
        return {"input_ids": ids, "attention_mask": mask, "labels": torch.zeros(B, dtype=torch.long)}
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.clone()}


def trainer_inputs(trainer: Any, batch: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """The forward's keyword arguments as `Trainer.compute_loss` passes them."""
    inputs = dict(batch)
    if trainer.model_accepts_loss_kwargs and "labels" in batch:
        inputs["num_items_in_batch"] = torch.tensor(float(batch["labels"].numel()))
    return inputs


def profiled_peak(trainer: Any, inputs: Dict[str, torch.Tensor]) -> int:
    """The most bytes alive during a real step after a first one: what was alive before it plus
    the profiler's allocations and frees summed in time order."""
    start, peak = real_step_peak(trainer.model, trainer.optimizer, [inputs])
    return start + peak


def plan_of(kind: str, dtype: torch.dtype, attn: str = None, ckpt: bool = False, lora: bool = False) -> Any:
    sizes = {"seq_len": None} if kind in ("vit", "whisper") else {"seq_len": S}
    if kind in ("bart", "t5", "whisper"):
        sizes["target_len"] = T
    plan, _ = plan_step_memory(meta_builder(kind, attn, lora), batch_size=B, 
        precision="bf16" if dtype == torch.bfloat16 else "fp32", optimizer="adamw_torch", attn_implementation=attn,
        gradient_checkpointing=ckpt, model_states=False, device_type="cpu", **sizes)  # the CPU optimizer loop
    assert plan.step.problem is None, plan.step.problem
    return plan


# The CPU generator's state, `torch.get_rng_state()` (5,056 bytes: mt19937's), which checkpointing
# keeps per block from forward to its recomputation (`preserve_rng_state=True`): a real CPU step
# holds it outside autograd, and the trace counts it (plan.step.rng_states). Without it, the real
# peak was 5,064 bytes above the plan with non-reentrant checkpointing (eager and SDPA alike).
CPU_RNG_STATE_BYTES = 5056

CASES = [(kind, torch.float32, None, False, False) for kind in FAMILIES] + [
    ("mixtral", torch.bfloat16, None, False, False),
    ("qwen3-moe", torch.bfloat16, None, False, False),
    ("gpt-neox", torch.float32, "eager", False, False),
    ("phi3", torch.float32, "eager", False, False),
    ("llama", torch.float32, None, False, True),
    ("llama", torch.float32, None, True, False),
    ("llama", torch.float32, "eager", True, False),
]


def case_id(case: Tuple) -> str:
    kind, dtype, attn, ckpt, lora = case
    return "-".join([kind, str(dtype).replace("torch.", ""), attn or "default"] + (["ckpt"] if ckpt else [])
                    + (["lora"] if lora else []))


@pytest.mark.parametrize("kind,dtype,attn,ckpt,lora", CASES, ids=[case_id(c) for c in CASES])
def test_a_familys_planned_step_matches_a_real_trainer_step(kind: str, dtype: torch.dtype, attn: str, ckpt: bool,
                                                            lora: bool) -> None:
    if installed_version("transformers") < (5,) and kind in OLDER_TRANSFORMERS_CANNOT:
        pytest.skip(OLDER_TRANSFORMERS_CANNOT[kind])
    plan = plan_of(kind, dtype, attn, ckpt, lora)
    trainer = real_trainer(kind, dtype, attn, ckpt, lora)
    if installed_version("transformers") >= (5,):  # what the Trainer set, and the plan traced (4.x sets none)
        assert trainer.model.config.use_cache is False
    inputs = trainer_inputs(trainer, collated_batch(kind, trainer.model))
    real = independent_saved_bytes(trainer.model, inputs, alive_at_end=True)
    assert real > 0
    assert plan.step.activations_bytes == real
    peak = profiled_peak(trainer, inputs)
    assert torch.get_rng_state().numel() == CPU_RNG_STATE_BYTES
    # With checkpointing the generator's states are in the plan: once at this peak non-reentrant,
    # twice reentrant (transformers 4.x's: each of the two blocks' contexts keeps one until its backward).
    assert abs(peak - plan.step.peak_bytes) <= 64
    # A CPU plan counts them, so it has nothing to say of them.
    assert not any("generator's state" in note for note in plan.step.notes)

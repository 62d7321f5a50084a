"""The model zoo: transformers architectures users bring, from tiny random configs.

Every entry of ``ZOO`` is one architecture built in code from a tiny random
config (2 layers, or one encoder and one decoder layer; width 32, vocabulary 96,
dropout 0; no download, no hub, no tokenizer) with the example batch of its kind,
and what compiling it must give:

    ZooModel("llama", "causal LM", build=..., batch=tokens,
             expected="match", tolerance=F32_LOSS)             # matches eager
    ZooModel("resnet", "vision classification", ...,
             expected="two-phase", tolerance=F64)    # matches eager, a two-phase step

One case is one training step on an uneven plan, ``GBS = 7`` samples over
``NUM_CSX = 2`` systems with ``MBS = 2`` (systems get 4 and 3 samples, run as
microbatches 2+2 and 2+1), against one eager step on the whole batch: the loss,
every output tensor and every parameter's gradient. A model whose ops mix samples
(BatchNorm in training) runs as a two-phase step (``compile``'s default coupling)
and must match all the same; ``"reject:<reason>"`` would expect a ``MixingError``
for what no two-phase step can run. Text batches are right-padded
with lengths 8, 5, 3, 8, 1, 6, 2 and -100 labels on the padding, so
microbatches hold different numbers of real tokens.

A model whose compile is refused today although the issue says it must match
keeps ``expected="match"`` and records the first line of today's error in
``known_failure``; ``tests/test_zoo.py`` marks it ``xfail(strict=True)``, so
the test flips to a failure the day the fix lands, and that entry is updated.

``run_case`` is the one definition of a case, shared by the test and by
``benchmarks/zoo_table.py``, which writes docs/zoo.md's table from its outcomes.
"""

from __future__ import annotations

import dataclasses
import inspect
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from models import grad_errors, grads_of, plan_free, rel_err, tensor_leaves

__all__ = [
    "F32_INSIDE",
    "F32_LOSS",
    "F32_MODEL",
    "F64",
    "FAMILIES",
    "GBS",
    "GRAD_FLOOR",
    "MATCHES",
    "MBS",
    "NUM_CSX",
    "ZOO",
    "Case",
    "Outcome",
    "Tolerance",
    "ZooModel",
    "build_case",
    "compare",
    "compile_case",
    "first_line",
    "is_two_phase",
    "run_case",
]

GBS, NUM_CSX, MBS = 7, 2, 2  # systems get 4 and 3 samples: microbatches 2, 2 | 2, 1
SEQ, VOCAB, WIDTH, LAYERS, HEADS = 8, 96, 32, 2, 4
LENGTHS = (8, 5, 3, 8, 1, 6, 2)  # real tokens per sample; one sample has a single token
IMAGE, CLASSES = 32, 5
# Attention key biases get a gradient that is zero up to rounding (softmax ignores a
# shift): each gradient is measured against at least this fraction of the largest.
GRAD_FLOOR = 1e-4


# --------------------------------------------------------------------------- #
# Tolerance classes: each says why it is what it is
# --------------------------------------------------------------------------- #


#: The expectations that compare against eager: a plain split, or a two-phase step.
MATCHES = ("match", "two-phase")


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """How close a case must come to eager, the loss dtype that proves why, and the reason."""

    name: str
    tol: float
    loss_dtype: torch.dtype  # the eager loss's dtype: the test checks the reason holds
    why: str
    grad_floor: float = GRAD_FLOOR  # gradients are measured against at least this x largest


F64 = Tolerance("float64", 1e-10, torch.float64,
                "float64 end to end: only the order of additions differs from eager")
F32_LOSS = Tolerance("float32 loss", 1e-5, torch.float32,
                     "the model is float64, but transformers computes the loss in float32 "
                     "(ForCausalLMLoss upcasts the logits with .float(); Llama-style RMSNorms "
                     "also normalise in float32), so the loss and every gradient through it "
                     "carry float32 rounding")
F32_INSIDE = Tolerance("float32 inside", 1e-5, torch.float64,
                       "the model and its loss are float64, but a layer computes in float32 "
                       "(the entry's why names it): gradients carry float32 rounding, and a "
                       "gradient that cancels to zero in exact arithmetic (an attention key "
                       "bias, which softmax ignores) keeps float32 noise of its terms, so "
                       "gradients are measured against at least 1e-3 of the largest",
                       grad_floor=1e-3)
F32_MODEL = Tolerance("float32 model", 1e-5, torch.float32,
                      "the model runs in float32 (grouped_mm, the MoE expert kernel, has no "
                      "float64): microbatches round differently from the full batch")


# --------------------------------------------------------------------------- #
# Example batches: no tokenizer, shared by every model of a kind
# --------------------------------------------------------------------------- #


def _mask(n: int, lengths: tuple[int, ...] = LENGTHS) -> torch.Tensor:
    return (torch.arange(SEQ)[None, :] < torch.tensor(lengths[:n])[:, None]).long()


def tokens(n: int = GBS) -> dict[str, Any]:
    """Right-padded ids (pad 0), mask and next-token / masked-LM labels (-100 on padding)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (n, SEQ), generator=g)
    mask = _mask(n)
    return {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask,
            "labels": ids.masked_fill(mask == 0, -100)}


def classes(n: int = GBS) -> dict[str, Any]:
    """The padded ids and mask of ``tokens`` with one class label per sample."""
    batch = tokens(n)
    g = torch.Generator().manual_seed(2)
    return {**batch, "labels": torch.randint(0, CLASSES, (n,), generator=g)}


def scores(n: int = GBS) -> dict[str, Any]:
    """The padded ids and mask of ``tokens`` with one float target per sample (regression)."""
    batch = tokens(n)
    g = torch.Generator().manual_seed(3)
    return {**batch, "labels": torch.randn(n, generator=g, dtype=torch.float64)}


def pairs(n: int = GBS) -> dict[str, Any]:
    """Seq2seq: padded source ids and mask, target labels of other lengths (-100 padding).

    The decoder inputs come from the labels inside the model (``shift_tokens_right``).
    """
    batch = tokens(n)
    g = torch.Generator().manual_seed(4)
    target = torch.randint(3, VOCAB, (n, SEQ), generator=g)
    tmask = _mask(n, (3, 8, 6, 2, 8, 1, 5))
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"],
            "labels": target.masked_fill(tmask == 0, -100)}


def images(n: int = GBS) -> dict[str, Any]:
    """Random 3x32x32 float64 images and a class label per image."""
    g = torch.Generator().manual_seed(5)
    return {"pixel_values": torch.randn(n, 3, IMAGE, IMAGE, generator=g, dtype=torch.float64),
            "labels": torch.randint(0, CLASSES, (n,), generator=g)}


# --------------------------------------------------------------------------- #
# Builders: a tiny random config per architecture
# --------------------------------------------------------------------------- #

# Llama-style configs share these names (others map them through attribute_map).
DECODER = dict(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=2 * WIDTH,
               num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=2,
               max_position_embeddings=32, pad_token_id=0, bos_token_id=1, eos_token_id=2)
ENCODER = dict(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=2 * WIDTH,
               num_hidden_layers=LAYERS, num_attention_heads=HEADS,
               max_position_embeddings=32, pad_token_id=0)
# Seq2seq: one encoder and one decoder layer (two layers in all; each costs a compile).
SEQ2SEQ = dict(vocab_size=VOCAB, d_model=WIDTH, encoder_layers=1, decoder_layers=1,
               encoder_attention_heads=HEADS, decoder_attention_heads=HEADS,
               encoder_ffn_dim=2 * WIDTH, decoder_ffn_dim=2 * WIDTH, max_position_embeddings=32,
               pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=2)
T5 = dict(vocab_size=VOCAB, d_model=WIDTH, d_kv=8, d_ff=2 * WIDTH, num_layers=1,
          num_decoder_layers=1, num_heads=HEADS, relative_attention_num_buckets=8,
          pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
VISION = dict(image_size=IMAGE, patch_size=8, num_channels=3, hidden_size=WIDTH,
              num_hidden_layers=LAYERS, num_attention_heads=HEADS, intermediate_size=2 * WIDTH,
              num_labels=CLASSES)
MOE = dict(DECODER, num_experts=4, num_local_experts=4, num_experts_per_tok=2,
           moe_intermediate_size=WIDTH, output_router_logits=False)


def _no_randomness(config: Any) -> Any:
    """Every dropout, layer drop, drop path and router jitter to 0: training is deterministic."""
    for key, value in config.to_dict().items():
        if ("drop" in key or "jitter" in key) and isinstance(value, float):
            setattr(config, key, 0.0)
    return config


def hf(model_class: str, config_class: str, *, dtype: torch.dtype = torch.float64,
       **config: Any) -> Callable[[], nn.Module]:
    """A builder: ``transformers.<model_class>(<config_class>(**config))``, seeded, in ``dtype``."""

    def build() -> nn.Module:
        import transformers

        cfg = _no_randomness(getattr(transformers, config_class)(**config))
        torch.manual_seed(0)
        return getattr(transformers, model_class)(cfg).to(dtype).train()

    build.__qualname__ = f"hf({model_class})"
    return build


def lora_llama() -> nn.Module:
    """``peft.get_peft_model`` on a tiny Llama: LoRA on q and v, only the adapters train."""
    import peft

    model = hf("LlamaForCausalLM", "LlamaConfig", **DECODER)()
    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                           target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    torch.manual_seed(0)
    model = peft.get_peft_model(model, lora)
    for name, p in model.named_parameters():  # B starts at zero: give it values to compare
        if "lora_B" in name:
            nn.init.normal_(p, std=0.02)
    return model.double()


# --------------------------------------------------------------------------- #
# The registry
# --------------------------------------------------------------------------- #


@dataclasses.dataclass(frozen=True)
class ZooModel:
    """One architecture, its batch, and what compiling it must give.

    ``expected`` is ``"match"`` (within ``tolerance``, microbatched plainly),
    ``"two-phase"`` (within ``tolerance``, run as a two-phase step: its ops mix samples)
    or ``"reject:<substring>"`` (a ``MixingError`` whose message contains the
    substring, case-insensitive).
    ``why`` says why the tolerance or the rejection is what it is, where the class's
    own reason does not say it all. ``known_failure`` is the first line of today's
    error for a model that must match but is refused now; ``None`` when it works.
    """

    name: str
    family: str
    build: Callable[[], nn.Module]
    batch: Callable[[int], dict[str, Any]]
    expected: str = "match"
    tolerance: Tolerance | None = None
    why: str = ""
    known_failure: str | None = None
    requires: str = "transformers"  # the module the builder imports

    def __post_init__(self) -> None:
        assert self.expected in MATCHES or self.expected.startswith("reject:"), self.expected
        assert (self.tolerance is not None) == (self.expected in MATCHES), self.name
        assert self.known_failure is None or self.expected == "match", self.name


CAUSAL, MASKED, CLASSIFY, SEQ2SEQ_LM, VISION_CLS, MOE_LM, PEFT = (
    "causal LM", "masked LM", "sequence classification", "seq2seq", "vision classification",
    "MoE causal LM", "PEFT LoRA")
FAMILIES = (CAUSAL, MASKED, CLASSIFY, SEQ2SEQ_LM, VISION_CLS, MOE_LM, PEFT)

# One factory per family: the family's defaults, config overrides as keywords.


def causal(name: str, model: str, config: str, *, known_failure: str | None = None,
           **cfg: Any) -> ZooModel:
    """A causal LM with the stock loss: float32 rounding (ForCausalLMLoss upcasts)."""
    return ZooModel(name, CAUSAL, hf(model, config, **{**DECODER, **cfg}), tokens,
                    tolerance=F32_LOSS, known_failure=known_failure)


def masked(name: str, model: str, config: str, *, base: dict[str, Any] = ENCODER,
           tolerance: Tolerance = F64, why: str = "", known_failure: str | None = None,
           **cfg: Any) -> ZooModel:
    return ZooModel(name, MASKED, hf(model, config, **{**base, **cfg}), tokens,
                    tolerance=tolerance, why=why, known_failure=known_failure)


def seq2seq(name: str, model: str, config: str, *, base: dict[str, Any] = SEQ2SEQ,
            tolerance: Tolerance = F64, why: str = "", known_failure: str | None = None,
            **cfg: Any) -> ZooModel:
    return ZooModel(name, SEQ2SEQ_LM, hf(model, config, **{**base, **cfg}), pairs,
                    tolerance=tolerance, why=why, known_failure=known_failure)


def vision(name: str, model: str, config: str, *, base: dict[str, Any] = VISION,
           expected: str = "match", why: str = "", known_failure: str | None = None,
           **cfg: Any) -> ZooModel:
    return ZooModel(name, VISION_CLS, hf(model, config, **{**base, **cfg}), images,
                    expected=expected, tolerance=F64 if expected in MATCHES else None,
                    why=why, known_failure=known_failure)


def moe(name: str, model: str, config: str, *, why: str = "",
        known_failure: str | None = None, **cfg: Any) -> ZooModel:
    """An MoE LM in float32 (grouped_mm has no float64), its router aux loss off."""
    return ZooModel(name, MOE_LM, hf(model, config, dtype=torch.float32, **{**MOE, **cfg}),
                    tokens, tolerance=F32_MODEL, why=why, known_failure=known_failure)


BATCH_NORM = ("two-phase",
              "BatchNorm in training normalises with the statistics of the whole batch: "
              "a plain split would change every sample's output (issue 12, item 6), so it "
              "runs as a two-phase step, the statistics taken once on the whole batch")
RMS_NORM_F32 = "LlamaRMSNorm normalises in float32 whatever the model's dtype"
T5_NORM_F32 = "T5LayerNorm computes the variance in float32 (hidden_states.to(torch.float32))"
FUNNEL = dict(vocab_size=VOCAB, d_model=WIDTH, n_head=HEADS, num_decoder_layers=1,
              pad_token_id=0)  # no layer count
SMALL_CNN = dict(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=CLASSES)

ZOO: tuple[ZooModel, ...] = (
    causal("gpt2", "GPT2LMHeadModel", "GPT2Config"),
    causal("gpt_neo", "GPTNeoForCausalLM", "GPTNeoConfig", window_size=4,
           attention_types=[[["global", "local"], 1]]),
    causal("gpt_neox", "GPTNeoXForCausalLM", "GPTNeoXConfig"),
    causal("gptj", "GPTJForCausalLM", "GPTJConfig", rotary_dim=4),
    causal("opt", "OPTForCausalLM", "OPTConfig", ffn_dim=2 * WIDTH, word_embed_proj_dim=WIDTH),
    causal("bloom", "BloomForCausalLM", "BloomConfig"),
    causal("llama", "LlamaForCausalLM", "LlamaConfig"),
    causal("mistral", "MistralForCausalLM", "MistralConfig"),
    causal("qwen2", "Qwen2ForCausalLM", "Qwen2Config"),
    causal("qwen3", "Qwen3ForCausalLM", "Qwen3Config", head_dim=8),
    causal("gemma", "GemmaForCausalLM", "GemmaConfig", head_dim=8),
    causal("gemma2", "Gemma2ForCausalLM", "Gemma2Config", head_dim=8),
    causal("gemma3", "Gemma3ForCausalLM", "Gemma3TextConfig", head_dim=8, sliding_window=4),
    causal("phi", "PhiForCausalLM", "PhiConfig"),
    causal("phi3", "Phi3ForCausalLM", "Phi3Config"),
    causal("stablelm", "StableLmForCausalLM", "StableLmConfig"),
    causal("starcoder2", "Starcoder2ForCausalLM", "Starcoder2Config"),
    causal("codegen", "CodeGenForCausalLM", "CodeGenConfig", rotary_dim=4, n_ctx=32),
    causal("olmo", "OlmoForCausalLM", "OlmoConfig"),
    causal("olmo2", "Olmo2ForCausalLM", "Olmo2Config"),
    causal("cohere", "CohereForCausalLM", "CohereConfig"),
    causal("granite", "GraniteForCausalLM", "GraniteConfig"),
    causal("falcon", "FalconForCausalLM", "FalconConfig"),
    causal("mamba", "MambaForCausalLM", "MambaConfig", state_size=4, expand=2, conv_kernel=4),
    masked("bert", "BertForMaskedLM", "BertConfig"),
    masked("roberta", "RobertaForMaskedLM", "RobertaConfig", pad_token_id=1),
    masked("distilbert", "DistilBertForMaskedLM", "DistilBertConfig", hidden_dim=2 * WIDTH),
    masked("albert", "AlbertForMaskedLM", "AlbertConfig", embedding_size=16),
    masked("electra", "ElectraForMaskedLM", "ElectraConfig", embedding_size=16),
    masked("mpnet", "MPNetForMaskedLM", "MPNetConfig"),
    masked("convbert", "ConvBertForMaskedLM", "ConvBertConfig", embedding_size=WIDTH,
           conv_kernel_size=3),
    masked("deberta", "DebertaForMaskedLM", "DebertaConfig", tolerance=F32_INSIDE,
           why="DebertaLayerNorm normalises in float32 (hidden_states.float())"),
    masked("deberta_v2", "DebertaV2ForMaskedLM", "DebertaV2Config"),
    masked("roformer", "RoFormerForMaskedLM", "RoFormerConfig"),
    masked("funnel", "FunnelForMaskedLM", "FunnelConfig", base=FUNNEL, block_sizes=[1, 1],
           d_head=8, d_inner=2 * WIDTH, tolerance=F32_INSIDE,
           why="FunnelRelMultiheadAttention casts its scores to float32 and back "
               "(attn_score.float(), softmax(dtype=float64)); autograd casts the scores' "
               "gradient to float32 on the way back. Eager's gradient there is of the mean "
               "(g/N, rounded to float32); the compiled step backpropagates each "
               "microbatch's partial sum from 1 and scales the step's gradient by 1/N "
               "afterwards, so it rounds g, not g/N: fl32(g)/N differs from fl32(g/N) at "
               "float32 rounding unless N (33 tokens here) is a power of two. The captured "
               "graph itself, run by autograd on the whole batch, equals eager exactly"),
    ZooModel("bert_classification", CLASSIFY,
             hf("BertForSequenceClassification", "BertConfig", **ENCODER, num_labels=CLASSES),
             classes, tolerance=F64),
    ZooModel("bert_regression", CLASSIFY,
             hf("BertForSequenceClassification", "BertConfig", **ENCODER, num_labels=1),
             scores, tolerance=F64, ),
    ZooModel("gpt2_classification", CLASSIFY,
             hf("GPT2ForSequenceClassification", "GPT2Config", **DECODER, num_labels=CLASSES),
             classes, tolerance=F64),
    ZooModel("llama_classification", CLASSIFY,
             hf("LlamaForSequenceClassification", "LlamaConfig", **DECODER,
                num_labels=CLASSES), classes, tolerance=F32_INSIDE, why=RMS_NORM_F32),
    seq2seq("t5", "T5ForConditionalGeneration", "T5Config", base=T5, tolerance=F32_INSIDE,
            why=T5_NORM_F32),
    seq2seq("mt5", "MT5ForConditionalGeneration", "MT5Config", base=T5, tolerance=F32_INSIDE,
            why=T5_NORM_F32),
    seq2seq("umt5", "UMT5ForConditionalGeneration", "UMT5Config", base=T5,
            tolerance=F32_INSIDE, why=T5_NORM_F32),
    seq2seq("longt5", "LongT5ForConditionalGeneration", "LongT5Config", base=T5,
            local_radius=2, global_block_size=4, tolerance=F32_INSIDE, why=T5_NORM_F32),
    seq2seq("bart", "BartForConditionalGeneration", "BartConfig"),
    seq2seq("mbart", "MBartForConditionalGeneration", "MBartConfig"),
    seq2seq("pegasus", "PegasusForConditionalGeneration", "PegasusConfig"),
    seq2seq("marian", "MarianMTModel", "MarianConfig"),
    seq2seq("blenderbot_small", "BlenderbotSmallForConditionalGeneration",
            "BlenderbotSmallConfig"),
    vision("vit", "ViTForImageClassification", "ViTConfig"),
    vision("deit", "DeiTForImageClassification", "DeiTConfig"),
    vision("dinov2", "Dinov2ForImageClassification", "Dinov2Config"),
    vision("convnext", "ConvNextForImageClassification", "ConvNextConfig", base={},
           num_labels=CLASSES, hidden_sizes=[8, 16], depths=[1, 1], num_stages=2,
           patch_size=4),
    vision("swin", "SwinForImageClassification", "SwinConfig", base={}, image_size=IMAGE,
           patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4,
           num_labels=CLASSES),
    vision("resnet", "ResNetForImageClassification", "ResNetConfig", base=SMALL_CNN,
           expected=BATCH_NORM[0], why=BATCH_NORM[1]),
    moe("mixtral", "MixtralForCausalLM", "MixtralConfig"),
    moe("qwen2_moe", "Qwen2MoeForCausalLM", "Qwen2MoeConfig",
        shared_expert_intermediate_size=WIDTH),
    moe("qwen3_moe", "Qwen3MoeForCausalLM", "Qwen3MoeConfig"),
    moe("olmoe", "OlmoeForCausalLM", "OlmoeConfig"),
    moe("granitemoe", "GraniteMoeForCausalLM", "GraniteMoeConfig"),
    ZooModel("llama_lora", PEFT, lora_llama, tokens, tolerance=F32_LOSS, requires="peft"),
)


# --------------------------------------------------------------------------- #
# One case: compile, one compiled step, one eager step, compare
# --------------------------------------------------------------------------- #


@dataclasses.dataclass
class Case:
    """A built model and its example call."""

    entry: ZooModel
    model: nn.Module
    kwargs: dict[str, Any]


def build_case(entry: ZooModel) -> Case:
    model = entry.build()
    kwargs = entry.batch(GBS)
    if "use_cache" in inspect.signature(model.forward).parameters:
        kwargs["use_cache"] = False  # compile switches the cache off; eager must too
    return Case(entry, model, kwargs)


def compile_case(case: Case) -> Any:
    import mbcompile

    return mbcompile.compile(case.model, GBS, NUM_CSX, MBS, example_kwargs=case.kwargs,
                             **plan_free(MBS))


def _loss_of(out: Any) -> torch.Tensor:
    return out["loss"] if isinstance(out, dict) else out.loss


def compare(case: Case, cm: Any) -> dict[str, Any]:
    """One compiled and one eager training step: errors of the loss, outputs and gradients.

    Returns ``{"loss": err, "outputs": {path: err}, "grads": {name: err},
    "loss_dtype": dtype, "trainable": names}``.
    """
    model, kwargs = case.model, case.kwargs
    floor = case.entry.tolerance.grad_floor if case.entry.tolerance else GRAD_FLOOR
    model.zero_grad(set_to_none=True)
    out = cm(**kwargs)
    _loss_of(out).backward()
    got = grads_of(model)
    model.zero_grad(set_to_none=True)
    ref = model(**kwargs)
    _loss_of(ref).backward()
    want = grads_of(model)
    model.zero_grad(set_to_none=True)
    got_leaves, want_leaves = tensor_leaves(out), tensor_leaves(ref)
    assert [p for p, _ in got_leaves] == [p for p, _ in want_leaves], (
        f"output structure differs: {[p for p, _ in got_leaves]} vs "
        f"{[p for p, _ in want_leaves]}")
    return {"loss": rel_err(_loss_of(out).detach(), _loss_of(ref).detach()),
            "outputs": {p: rel_err(a.detach(), b.detach())
                        for (p, a), (_, b) in zip(got_leaves, want_leaves)},
            "grads": grad_errors(got, want, floor),
            "loss_dtype": _loss_of(ref).dtype,
            "trainable": sorted(n for n, p in model.named_parameters() if p.requires_grad)}


def is_two_phase(cm: Any) -> bool:
    """The compiled step is a two-phase step (the plan's reason says so)."""
    return "two-phase step" in cm.plan.reason


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


@dataclasses.dataclass
class Outcome:
    """What running one entry gave: ``result`` is match, mismatch, rejected or error;
    ``two_phase``: the compiled step was a two-phase step."""

    entry: ZooModel
    result: str
    detail: str = ""  # the first line of the error, or the largest error
    message: str = ""  # the whole error message
    compile_s: float = 0.0  # wall
    compile_cpu_s: float = 0.0
    total_s: float = 0.0
    worst: float = 0.0
    two_phase: bool = False

    @property
    def as_expected(self) -> bool:
        e = self.entry
        if e.expected in MATCHES:
            return self.result == "match" and self.two_phase == (e.expected == "two-phase")
        return self.result == "rejected" and e.expected[len("reject:"):].lower() in (
            self.message.lower())


def worst_error(errors: dict[str, Any]) -> float:
    values = [errors["loss"], *errors["outputs"].values(), *errors["grads"].values()]
    return max((v if v == v else float("inf")) for v in values)  # NaN counts as inf


def run_case(entry: ZooModel) -> Outcome:
    """Run one entry, catching everything: the table's view of a case."""
    from mbcompile import MixingError

    start = time.perf_counter()
    try:
        case = build_case(entry)
        t0, c0 = time.perf_counter(), time.process_time()
        cm = compile_case(case)
        compile_s, compile_cpu_s = time.perf_counter() - t0, time.process_time() - c0
        two_phase = is_two_phase(cm)
        errors = compare(case, cm)
    except MixingError as exc:
        return Outcome(entry, "rejected", first_line(exc), str(exc),
                       total_s=time.perf_counter() - start)
    except Exception as exc:  # noqa: BLE001 - the table reports every failure
        return Outcome(entry, "error", first_line(exc), str(exc),
                       total_s=time.perf_counter() - start)
    worst = worst_error(errors)
    tol = entry.tolerance.tol if entry.tolerance else F64.tol
    return Outcome(entry, "match" if worst <= tol else "mismatch", f"max rel err {worst:.1e}",
                   compile_s=compile_s, compile_cpu_s=compile_cpu_s,
                   total_s=time.perf_counter() - start, worst=worst, two_phase=two_phase)

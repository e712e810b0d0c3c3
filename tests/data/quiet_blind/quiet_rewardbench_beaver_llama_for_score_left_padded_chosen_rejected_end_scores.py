# Citation: allenai/reward-bench @05a9005 (rewardbench/models/beaver.py: ScoreModelMixin.get_scores, LlamaForScore,
#   BeaverPipeline, "mostly copied from" PKU-Alignment/safe-rlhf safe_rlhf/models/score_model/__init__.py and
#   score_model/llama/modeling_llama.py; rewardbench/rewardbench.py: the classifier branch that sets
#   tokenizer.padding_side = "left" and the inference loop over text_chosen / text_rejected).
# RewardBench scores a preference set with a safe-rlhf Beaver reward model. Each batch of the DataLoader holds a few
# (prompt, chosen, rejected) rows; the pipeline is called once on the chosen texts and once on the rejected texts, and
# each call tokenizes its texts with padding=True on the side the script set: LEFT ("padding experiments for
# determinism"). LlamaForScore runs LlamaModel with that attention_mask (no position_ids, as the pipeline passes none)
# and reads each row's end score at `end_index = torch.cat([m.nonzero()[-1] for m in attention_mask])`, the last 1 of
# the row, which under left padding is the last column. A pair counts as won when the chosen end score is higher.
# Self-check: every text tokenized and scored alone (no padding, no mask), its end score at its own last token; the
# batched end scores, end indices, end hidden states and the win / loss results must equal the per-text ones.
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn as nn
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import LlamaConfig, LlamaModel, LlamaPreTrainedModel, PretrainedConfig, PreTrainedTokenizerFast
from transformers.utils.generic import ModelOutput

torch.manual_seed(0)


# ---- rewardbench/models/beaver.py (normalizer: the identity one that normalizer_type=None instantiates) ----
class IdentityNormalizer(nn.Module):
    """Identity normalizer."""

    def __init__(self, normalize_function, shape, device=None) -> None:
        super().__init__()
        self.normalize_function = normalize_function
        self.register_buffer("mean", torch.zeros(shape, device=device))
        self.register_buffer("var", torch.ones(shape, device=device))
        self.register_buffer("count", torch.zeros(1, dtype=torch.long, device=device))

    def update(self, data: torch.Tensor) -> None:
        """Update mean and variance."""
        self.count += data.size(0)  # pylint: disable=no-member

    def normalize(self, data: torch.Tensor, epsilon=1e-8) -> torch.Tensor:
        if self.normalize_function == "affine":
            return (data - self.mean.detach()) / (self.var.sqrt().detach() + epsilon)
        if self.normalize_function == "scale":
            return data / (self.var.sqrt().detach() + epsilon)
        if self.normalize_function == "translate":
            return data - self.mean.detach()
        return data


@dataclass
class ScoreModelOutput(ModelOutput):
    scores: torch.FloatTensor | None = None  # size = (B, L, D)
    end_scores: torch.FloatTensor | None = None  # size = (B, D)
    last_hidden_state: torch.FloatTensor | None = None  # size = (B, L, E)
    end_last_hidden_state: torch.FloatTensor | None = None  # size = (B, E)
    end_index: torch.LongTensor | None = None  # size = (B,)


class ScoreModelMixin:
    """Base class for score models."""

    score_head: nn.Linear
    normalizer: IdentityNormalizer
    do_normalize: bool = False
    normalize_function = "affine"
    _is_score_head_initialized: bool = False

    def init_score_head(self, config: PretrainedConfig, hidden_size: int, **kwargs: Any) -> None:
        """Initialize the score head."""
        if self._is_score_head_initialized:
            return

        config.score_dim = kwargs.pop("score_dim", getattr(config, "score_dim", 1))
        config.bias = kwargs.pop("bias", getattr(config, "bias", False))

        config.score_type = kwargs.pop("score_type", getattr(config, "score_type", "reward"))
        if config.score_type == "reward":
            self.normalize_function = "affine"
        elif config.score_type == "cost":
            self.normalize_function = "scale"
        elif config.score_type == "critic":
            self.normalize_function = "identity"

        config.do_normalize = kwargs.pop("do_normalize", getattr(config, "do_normalize", False))
        self.do_normalize = config.do_normalize

        self.score_head = nn.Linear(hidden_size, config.score_dim, bias=config.bias)
        self.normalizer = IdentityNormalizer(self.normalize_function, shape=(config.score_dim,))
        self._is_score_head_initialized = True

    def get_scores(
        self,
        last_hidden_state: torch.FloatTensor,  # size = (B, L, E)
        attention_mask: torch.BoolTensor | None = None,  # size = (B, L)
        return_dict: bool | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor] | ScoreModelOutput:
        """Forward pass of the score model."""
        B, L, E = last_hidden_state.size()

        if attention_mask is None:
            if B > 1:
                raise ValueError("'attention_mask' is required when batch size > 1.")
            attention_mask = last_hidden_state.new_ones(B, L, dtype=torch.bool)  # size = (B, L)

        scores = self.score_head(last_hidden_state).float()  # size = (B, L, D)

        end_index = torch.cat([m.nonzero()[-1] for m in attention_mask])  # size = (B,)
        end_last_hidden_state = torch.gather(  # size = (B, 1, E)
            last_hidden_state,
            dim=1,
            index=(
                end_index.to(last_hidden_state.device)
                .unsqueeze(dim=1)
                .unsqueeze(dim=2)
                .expand(-1, -1, last_hidden_state.size(-1))
            ),
        )
        end_scores = torch.gather(  # size = (B, 1, D)
            scores,
            dim=1,
            index=(end_index.to(scores.device).unsqueeze(dim=1).unsqueeze(dim=2).expand(-1, -1, scores.size(-1))),
        )
        end_last_hidden_state = end_last_hidden_state.squeeze(dim=1)  # size = (B, E)
        end_scores = end_scores.squeeze(dim=1)  # size = (B, D)

        if self.training:
            self.normalizer.update(end_scores)

        if self.do_normalize:
            scores = self.normalizer.normalize(scores)
            end_scores = self.normalizer.normalize(end_scores)

        if not return_dict:
            return scores, end_scores

        return ScoreModelOutput(
            scores=scores,  # size = (B, L, D)
            end_scores=end_scores,  # size = (B, D)
            last_hidden_state=last_hidden_state,  # size = (B, L, E)
            end_last_hidden_state=end_last_hidden_state,  # size = (B, E)
            end_index=end_index,  # size = (B,)
        )


class LlamaForScore(ScoreModelMixin, LlamaPreTrainedModel):
    _keys_to_ignore_on_load_missing: ClassVar[list[str]] = ["lm_head.weight"]

    def __init__(self, config: PretrainedConfig, **kwargs: Any) -> None:
        super().__init__(config)
        self.model = LlamaModel(config)

        config.architectures = [self.__class__.__name__]
        self.init_score_head(config, hidden_size=config.hidden_size, **kwargs)

        # Initialize weights and apply final processing
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.embed_tokens = value

    def forward(  # pylint: disable=too-many-arguments
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values=None,
        inputs_embeds: torch.FloatTensor | None = None,
        use_cache: bool | None = None,
        return_dict: bool | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor] | ScoreModelOutput:
        return_dict = return_dict if return_dict is not None else self.config.use_return_dict

        outputs = self.model(
            input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            output_attentions=False,
            output_hidden_states=False,
            return_dict=True,
        )
        last_hidden_state = outputs.last_hidden_state  # size = (B, L, E)
        return self.get_scores(
            last_hidden_state,
            attention_mask=attention_mask,
            return_dict=return_dict,
        )


# Pipeline addition
class BeaverPipeline:
    # init loads task, tokenizer and model
    def __init__(self, task, model, tokenizer):
        self.task = task
        self.model = model
        self.tokenizer = tokenizer

    def __call__(self, samples, **kwargs):
        _ = kwargs.get("batch_size", 1)
        truncation = kwargs.get("truncation", True)
        padding = kwargs.get("padding", True)
        max_length = kwargs.get("max_length", 2048)
        inputs = self.tokenizer(
            samples,
            truncation=truncation,
            max_length=max_length,
            padding=padding,
            return_tensors="pt",
        ).to(self.model.device)
        with torch.no_grad():
            outputs = self.model(**inputs)
        return outputs.end_scores


# ---- a tiny Llama-style tokenizer (BOS prepended, pad = <unk> id 0) and a tiny Beaver model ----
WORDS = (
    "<unk> <s> </s> BEGINNING OF CONVERSATION: USER: ASSISTANT: how do i bake bread ? what is the capital of france "
    "paris is it sure mix flour water yeast knead let rise then at 220 degrees no idea just buy some london "
    "answer two plus four six five please tell me a short joke why did chicken cross road to get other side"
).split()
vocab = {w: i for i, w in enumerate(dict.fromkeys(WORDS))}
backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", vocab["<s>"])])
tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
tokenizer.pad_token = "<unk>"

config = LlamaConfig(
    vocab_size=len(vocab),
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    pad_token_id=tokenizer.pad_token_id,
    bos_token_id=vocab["<s>"],
    eos_token_id=vocab["</s>"],
    attn_implementation="sdpa",
)
model = LlamaForScore(config, score_type="reward").to(torch.float64).eval()


def conv(prompt, answer):
    return f"BEGINNING OF CONVERSATION: USER: {prompt} ASSISTANT: {answer}"


dataset = [
    {"prompt": "how do i bake bread ?", "chosen": "mix flour water yeast knead let rise then bake at 220 degrees",
     "rejected": "no idea just buy some"},
    {"prompt": "what is the capital of france ?", "chosen": "paris", "rejected": "it is london i am sure"},
    {"prompt": "what is two plus four ?", "chosen": "six", "rejected": "five"},
    {"prompt": "please tell me a short joke", "chosen": "why did the chicken cross the road ? to get to the other side",
     "rejected": "no"},
    {"prompt": "how do i bake bread ?", "chosen": "mix flour water yeast", "rejected": "just buy some bread"},
]
dataset = [
    {"prompt": d["prompt"], "text_chosen": conv(d["prompt"], d["chosen"]),
     "text_rejected": conv(d["prompt"], d["rejected"])}
    for d in dataset
]

# ---- rewardbench/rewardbench.py: classifier pipeline branch and the inference loop ----
# padding experiments for determinism
tokenizer.padding_side = "left"
truncation = False
reward_pipeline_kwargs = {
    "batch_size": 3,
    "truncation": truncation,
    "padding": True,
    "max_length": 2048,
    "function_to_apply": "none",  # Compute raw logits
    "return_token_type_ids": False,
}
reward_pipe = BeaverPipeline("text-classification", model=model, tokenizer=tokenizer)
if reward_pipe.model.config.pad_token_id is None:
    reward_pipe.model.config.pad_token_id = reward_pipe.tokenizer.pad_token_id

dataloader = torch.utils.data.DataLoader(dataset, batch_size=3, shuffle=False, drop_last=False)

results = []
scores_chosen = []
scores_rejected = []
for step, batch in enumerate(dataloader):
    rewards_chosen = reward_pipe(batch["text_chosen"], **reward_pipeline_kwargs)
    rewards_rejected = reward_pipe(batch["text_rejected"], **reward_pipeline_kwargs)

    score_chosen_batch = rewards_chosen.float().cpu().numpy().tolist()
    score_rejected_batch = rewards_rejected.float().cpu().numpy().tolist()

    [
        results.append(1) if chosen > rejected else results.append(0)
        for chosen, rejected in zip(score_chosen_batch, score_rejected_batch)
    ]
    scores_chosen.extend(score_chosen_batch)
    scores_rejected.extend(score_rejected_batch)

accuracy = sum(results) / len(results)
print(f"Results: {accuracy}, on {len(results)} prompts")


# ---- self-check: every text scored alone, no padding, no mask ----
alone = {}
with torch.no_grad():
    for d in dataset:
        for key in ("text_chosen", "text_rejected"):
            ids = tokenizer(d[key], return_tensors="pt")["input_ids"]
            hidden = model.model(ids).last_hidden_state[0]  # (L, E)
            alone[d[key]] = (model.score_head(hidden).float()[-1], hidden)

worst = 0.0
for key, batched in (("text_chosen", scores_chosen), ("text_rejected", scores_rejected)):
    ref = torch.stack([alone[d[key]][0] for d in dataset]).double()
    got = torch.tensor(batched, dtype=torch.float64)
    worst = max(worst, (ref - got).abs().max().item())
    assert torch.allclose(ref, got, atol=1e-5), (key, ref, got)

ref_results = [int(alone[d["text_chosen"]][0].item() > alone[d["text_rejected"]][0].item()) for d in dataset]
assert results == ref_results, (results, ref_results)

# one padded batch in full: the end index is the last column, the end hidden state the text's own last hidden state
texts = [d["text_rejected"] for d in dataset]
inputs = tokenizer(texts, padding=True, return_tensors="pt")
assert (inputs["attention_mask"][:, -1] == 1).all() and (inputs["attention_mask"][:, 0] == 0).any()
with torch.no_grad():
    out = model(**inputs, return_dict=True)
L = inputs["input_ids"].size(1)
assert out.end_index.tolist() == [L - 1] * len(texts), out.end_index
for i, text in enumerate(texts):
    end_score, hidden = alone[text]
    n = hidden.size(0)
    assert torch.allclose(out.last_hidden_state[i, L - n:], hidden, atol=1e-8)
    assert torch.allclose(out.end_last_hidden_state[i], hidden[-1], atol=1e-8)
    assert torch.allclose(out.end_scores[i], end_score, atol=1e-6)

print(f"ok: {len(dataset)} pairs, batched end scores match per-text scores (max err {worst:.2e}), results {results}")

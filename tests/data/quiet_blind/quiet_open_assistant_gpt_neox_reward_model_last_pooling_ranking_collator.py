# Citation: LAION-AI/Open-Assistant model/model_training/models/reward_model.py
#   @26b0d896433fb6d41de30b338f8cf6e62ae85279 (GPTNeoXRewardModelConfig, GPTNeoXRewardModel, pooling "last");
#   model/model_training/custom_datasets/ranking_collator.py @17f5bc1eff80345f058e4a8af6df90648c247192
#   (RankingDataCollator.process_one / __call__); model/model_training/trainer_rm.py
#   @01c00de97e5240c358e403bfd67388877b195d83 (RMTrainer.compute_loss, pad_to_multiple_of=16);
#   model/model_training/losses.py (RMLoss, ranking over cu_lens).
# Open-Assistant's reward-model step. The RankingDataCollator tokenizes each conversation's prefix once and every
# ranked reply after it (prefix + reply, each turn closed by EOS), flattens all replies of all conversations into one
# list, records cu_lens, and pads the list with tokenizer.pad (right padding, pad_to_multiple_of=16). The GPT-NeoX
# reward model runs on (input_ids, attention_mask) and, with pooling "last", reads each row's hidden state at
# `attention_mask.cumsum(dim=1).argmax(dim=1)` (the first column where the count reaches its maximum: the last real
# token, the reply's EOS), through out_proj. RMLoss ranks every pair of replies inside each conversation.
# Self-check: each reply run alone (prefix + reply, no padding, no mask), its reward read at its own last token, and
# the ranking loss rebuilt by a double loop over each conversation's pairs.
from dataclasses import dataclass
from typing import Literal, Optional, Union

import torch
import torch.nn as nn
import torch.nn.functional as F
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXConfig, GPTNeoXModel, GPTNeoXPreTrainedModel
from transformers.tokenization_utils_base import BatchEncoding, PaddingStrategy, PreTrainedTokenizerBase
from transformers.utils import ModelOutput

torch.manual_seed(0)


# ---- model/model_training/custom_datasets/formatting.py ----
QA_SPECIAL_TOKENS = {
    "Question": "<|prompter|>",
    "Answer": "<|assistant|>",
    "System": "<|system|>",
    "StartPrefix": "<|prefix_begin|>",
    "EndPrefix": "<|prefix_end|>",
}


def format_pairs(pairs, eos_token, add_initial_reply_token=False):
    conversations = [
        "{}{}{}".format(QA_SPECIAL_TOKENS["Question" if i % 2 == 0 else "Answer"], pairs[i], eos_token)
        for i in range(len(pairs))
    ]
    if add_initial_reply_token:
        conversations.append(QA_SPECIAL_TOKENS["Answer"])
    return conversations


def format_reply(text, eos_token):
    return "{}{}{}".format(QA_SPECIAL_TOKENS["Answer"], text, eos_token)


# ---- model/model_training/custom_datasets/ranking_collator.py ----
@dataclass
class RankingDataCollator:
    """
    Data collator that will dynamically pad the inputs for multiple choice received.
    """

    tokenizer: PreTrainedTokenizerBase
    padding: Union[bool, str, PaddingStrategy] = True
    max_length: Optional[int] = None
    min_prefix_length: int = 256
    pad_to_multiple_of: Optional[int] = None
    max_replies: Optional[int] = 5

    def process_one(self, example, return_length: int = False) -> list[BatchEncoding]:
        assert self.tokenizer.eos_token
        eos = self.tokenizer.eos_token

        messages, replies = example

        if self.max_replies:
            assert self.max_replies > 1, "max_replies parameter must be > 1 or None"
            if len(replies) > self.max_replies:
                replies = replies[: self.max_replies]

        if messages is None or len(messages) == 1 and messages[0] is None:
            # special handling for non-dialogue datasets like Hellaswag
            prefix = ""
            replies = [r + eos for r in replies]
        else:
            # append eos token to each messages
            prefix = "".join(format_pairs(messages, eos_token=eos))
            replies = [format_reply(r, eos_token=eos) for r in replies]

        prefix_tokens = self.tokenizer(prefix, padding=False, truncation=False)
        reply_tokens = [self.tokenizer(r, padding=False, truncation=False) for r in replies]

        prefix_len = len(prefix_tokens.input_ids)
        suffix_len = max(len(r.input_ids) for r in reply_tokens)
        if return_length:
            return min(prefix_len + suffix_len, self.max_length)

        for r in reply_tokens:
            max_prefix_len = (
                prefix_len
                if self.max_length is None
                else max(self.min_prefix_length, self.max_length - len(r.input_ids))
            )
            max_suffix_len = len(r.input_ids) if self.max_length is None else self.max_length - max_prefix_len

            for k in r.keys():
                r[k] = prefix_tokens[k][-max_prefix_len:] + r[k][:max_suffix_len]

        return reply_tokens

    def __call__(self, examples):
        flat_tokenized, cu_lens = [], [0]
        n_samples = 0
        for example in examples:
            tokenized = self.process_one(example)
            flat_tokenized.extend(tokenized)

            n_samples += len(tokenized)
            cu_lens.append(n_samples)

        batch = self.tokenizer.pad(
            flat_tokenized,
            padding=self.padding,
            max_length=self.max_length,
            pad_to_multiple_of=self.pad_to_multiple_of,
            return_tensors="pt",
        )

        if "token_type_ids" in batch:
            batch.pop("token_type_ids")
        return (batch, cu_lens)


# ---- model/model_training/models/reward_model.py ----
class GPTNeoXRewardModelConfig(GPTNeoXConfig):
    model_type = "gpt_neox_reward_model"

    pooling: Literal["mean", "last"]

    def __init__(self, pooling: Literal["mean", "last"] = "last", **kwargs):
        super().__init__(**kwargs)
        self.pooling = pooling or "last"


@dataclass
class GPTNeoXRewardModelOutput(ModelOutput):
    logits: torch.FloatTensor = None


class GPTNeoXRewardModel(GPTNeoXPreTrainedModel):
    config_class = GPTNeoXRewardModelConfig

    def __init__(self, config):
        if type(config) == GPTNeoXConfig:
            config = GPTNeoXRewardModelConfig.from_dict(config.to_dict())
        super().__init__(config)

        self.gpt_neox = GPTNeoXModel(config)
        self.out_proj = nn.Linear(config.hidden_size, 1)
        self.pooling = config.pooling
        self.post_init()

    def forward(
        self,
        input_ids,
        attention_mask: Optional[torch.FloatTensor] = None,
        inputs_embeds: Optional[torch.FloatTensor] = None,
        use_cache: Optional[bool] = None,
        return_dict: Optional[bool] = True,
    ) -> GPTNeoXRewardModelOutput:
        outputs = self.gpt_neox(
            input_ids,
            attention_mask=attention_mask,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            return_dict=return_dict,
        )

        hidden_states = outputs[0]
        if self.pooling == "last":
            if attention_mask is None:
                pooled = hidden_states[:, -1]
            else:
                last_idx = attention_mask.cumsum(dim=1).argmax(dim=1)
                pooled = hidden_states.gather(1, last_idx.view(-1, 1, 1).expand(-1, 1, hidden_states.size(-1))).squeeze(
                    1
                )
        else:
            raise ValueError(f"Unknown pooling method: {self.pooling}")

        logits = self.out_proj(pooled)

        if not return_dict:
            return (logits,) + outputs[1:]

        return GPTNeoXRewardModelOutput(logits=logits)


# ---- model/model_training/losses.py ----
class RMLoss(nn.Module):
    def __init__(self, reduction="mean", beta=0.001):
        super().__init__()
        self.reduction = reduction
        self.beta = beta

    def forward(self, logits, cu_lengths=None):
        # if cu_lengths is None, assume that all examples belong to the same conversation
        if cu_lengths is None:
            cu_lengths = [0, logits.size(0)]

        device = logits.device
        losses = []
        for start, end in zip(cu_lengths[:-1], cu_lengths[1:]):
            pairs = torch.combinations(torch.arange(end - start, device=device), 2)
            pos_ids, neg_ids = pairs[:, 0], pairs[:, 1]
            pos_logits = logits.take(start + pos_ids)
            neg_logits = logits.take(start + neg_ids)

            l2 = 0.5 * (pos_logits**2 + neg_logits**2)
            _loss = (-F.logsigmoid(pos_logits - neg_logits) + self.beta * l2).mean()
            losses.append(_loss)
        loss = torch.stack(losses)

        if self.reduction == "none":
            return loss
        return loss.mean()


# ---- model/model_training/trainer_rm.py (RMTrainer.compute_loss, no Trainer around it) ----
def compute_loss(model, loss_fct, inputs, return_logits=False):
    batch, cu_lens = inputs

    logits = model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
    ).logits

    loss = loss_fct(logits, cu_lens)

    return (loss, logits) if return_logits else loss


# ---- a tiny word-level tokenizer standing in for the Pythia one (no download) ----
WORDS = (
    "how do i bake bread you mix flour water yeast and salt then knead it let rise bake at high heat "
    "what is the capital of france paris it is a city on seine i think maybe lyon no idea "
    "thanks sure anything else tell me a joke why did chicken cross road to get other side"
).split()
SPECIALS = ["<|padding|>", "<|endoftext|>", "[UNK]"] + list(QA_SPECIAL_TOKENS.values())
vocab = {t: i for i, t in enumerate(SPECIALS)}
for w in WORDS:
    vocab.setdefault(w, len(vocab))
tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
tokenizer = PreTrainedTokenizerFast(
    tokenizer_object=tk,
    pad_token="<|padding|>",
    eos_token="<|endoftext|>",
    unk_token="[UNK]",
    additional_special_tokens=list(QA_SPECIAL_TOKENS.values()),
)
tokenizer.padding_side = "right"

config = GPTNeoXConfig(
    vocab_size=len(vocab),
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    max_position_embeddings=128,
    rotary_pct=0.25,
    pad_token_id=tokenizer.pad_token_id,
    eos_token_id=tokenizer.eos_token_id,
)
model = GPTNeoXRewardModel(config).eval()
assert model.pooling == "last"

examples = [
    (
        ["how do i bake bread", " you mix flour water yeast and salt", " then what"],
        [" knead it let it rise then bake at high heat", " bake it", " no idea"],
    ),
    (["what is the capital of france"], [" paris", " i think it is a city on seine maybe lyon"]),
    (
        ["tell me a joke"],
        [" why did the chicken cross the road to get to the other side", " sure", " no", " thanks anything else"],
    ),
]

collate = RankingDataCollator(tokenizer, max_length=None, pad_to_multiple_of=16)
batch, cu_lens = collate(examples)
assert batch["input_ids"].shape[1] % 16 == 0
assert cu_lens == [0, 3, 5, 9]
loss_fct = RMLoss(beta=0.001)

with torch.no_grad():
    loss, logits = compute_loss(model, loss_fct, (batch, cu_lens), return_logits=True)

# ---- reference: each (prefix + reply) alone, unpadded ----
eos = tokenizer.eos_token
ref_logits = []
for messages, replies in examples:
    prefix = "".join(format_pairs(messages, eos_token=eos))
    for r in replies:
        ids = tokenizer(prefix + format_reply(r, eos_token=eos))["input_ids"]
        assert ids[-1] == tokenizer.eos_token_id
        with torch.no_grad():
            h = model.gpt_neox(torch.tensor([ids])).last_hidden_state
        ref_logits.append(model.out_proj(h[0, -1]))
ref_logits = torch.stack(ref_logits)  # (n_replies, 1)

assert logits.shape == ref_logits.shape, (logits.shape, ref_logits.shape)
err = (logits - ref_logits).abs().max().item()
assert err < 1e-4, err

ref_losses = []
for start, end in zip(cu_lens[:-1], cu_lens[1:]):
    terms = []
    for i in range(start, end):
        for j in range(i + 1, end):
            p, n = ref_logits[i, 0], ref_logits[j, 0]
            terms.append(-F.logsigmoid(p - n) + 0.001 * 0.5 * (p**2 + n**2))
    ref_losses.append(torch.stack(terms).mean())
ref_loss = torch.stack(ref_losses).mean()
assert abs(loss.item() - ref_loss.item()) < 1e-5, (loss.item(), ref_loss.item())

print(f"rewards {logits.squeeze(-1).tolist()}")
print(f"max |reward - per-reply reward| = {err:.2e}; RMLoss {loss.item():.6f} == double loop {ref_loss.item():.6f}")

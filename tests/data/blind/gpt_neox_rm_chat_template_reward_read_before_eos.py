# EleutherAI/gpt-neox#1285 ("Fix off by 1 error on masked tokens for RM training", commit f9b5329d), on the
# reward-model training path added in #1246 (forward_step's "rm" branch, as re-added in #1295, commit b0b490de).
#
# tools/datasets/preprocess_data_with_chat_template.py build_chat(for_rm=True) writes the chat's tokens plus one EOS,
# and a label row that is -100 everywhere except that EOS. Training reads the pair causally: input = tokens[:-1],
# label mask = (label >= 0)[1:], and forward_step gathers the value head at the nonzero entries of that mask. With a
# single EOS appended, the one nonzero position lands on the last chat token, so the reward is read one token before
# the EOS (the EOS itself is never an input). The fix appends EOS twice with labels [-100, EOS], so the gathered
# position is the EOS token.
#
# Trimmed port: build_chat (for_rm), PairwiseDataset.__getitem__ padding (tokens with 0, labels with -100 to
# seq_length + 1), _get_batch / get_ltor_masks_and_position_ids, the "rm" branch of forward_step. The megatron
# GPT2ModelPipe with its row-parallel rm_linear (hidden -> 1) is stood in for by transformers' GPTNeoXModel + a
# bias-free Linear. The tokenizer is a tiny word-level PreTrainedTokenizerFast with a ChatML template.
import sys

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import GPTNeoXConfig, GPTNeoXModel, PreTrainedTokenizerFast

FIXED = "--fixed" in sys.argv

torch.manual_seed(0)

# ---------------------------------------------------------------------------------------------------------------
# tokenizer (stand-in for the HF tokenizer the preprocessing script loads)
# ---------------------------------------------------------------------------------------------------------------
WORDS = [
    "<pad>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "user", "assistant", "\n",
    "what", "is", "two", "plus", "three", "five", "six", "it", "the", "answer", "name", "a", "colour",
    "blue", "green", "sky", "grass", "red", "i", "think", "maybe", "?", ".",
]
VOCAB = {w: i for i, w in enumerate(WORDS)}
_tok = Tokenizer(models.WordLevel(vocab=VOCAB, unk_token="<pad>"))
_tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|> {{ message['role'] }} {{ message['content'] }} <|im_end|> "
    "{% endfor %}"
)
tokenizer = PreTrainedTokenizerFast(
    tokenizer_object=_tok, pad_token="<pad>", eos_token="<|endoftext|>", chat_template=CHAT_TEMPLATE
)


# ---------------------------------------------------------------------------------------------------------------
# tools/datasets/preprocess_data_with_chat_template.py
# ---------------------------------------------------------------------------------------------------------------
def build_chat(chat, generation_role, apply_mask, tokenizer, only_last_turn=False, for_rm=False):
    tokens = []
    mask = []
    if apply_mask is False:
        tokens = tokenizer.apply_chat_template(chat, return_dict=False)
        mask = tokens
        return tokens, mask
    elif for_rm:
        tokens = tokenizer.apply_chat_template(chat, return_dict=False)  # (transformers 5 returns a dict by default)
        mask = [-100] * len(tokens)
        if tokenizer.eos_token_id is not None:
            if FIXED:
                # since this is processed in a causal format (input[:-1], mask[1:], we need to put two here...
                mask.append(-100)
                tokens.append(tokenizer.eos_token_id)
            mask.append(tokenizer.eos_token_id)
            tokens.append(tokenizer.eos_token_id)
        else:
            raise ValueError(
                "Tokenizer does not have an EOS token, unable to determine good mask, please edit and make your own."
            )
        return tokens, mask
    for i, turn in enumerate(chat):
        add_gen = False if i == len(chat) - 1 else chat[i + 1]["role"] == generation_role
        chat_tokens = tokenizer.apply_chat_template(chat[: i + 1], add_generation_prompt=add_gen, return_dict=False)[len(tokens):]
        tokens.extend(chat_tokens)
        if only_last_turn and (i != len(chat) - 1):
            mask.extend([-100] * len(chat_tokens))
        elif apply_mask and (turn["role"] != generation_role):
            mask.extend([-100] * len(chat_tokens))
        else:
            mask.extend(chat_tokens)
    if tokenizer.eos_token_id is not None:
        mask.append(tokenizer.eos_token_id if mask[-1] != -100 else -100)
        tokens.append(tokenizer.eos_token_id)
    return tokens, mask


# ---------------------------------------------------------------------------------------------------------------
# megatron/data/pairwise_dataset.py PairwiseDataset.__getitem__ (one document per sample; padding part)
# ---------------------------------------------------------------------------------------------------------------
def pairwise_item(pos, neg, pos_label, neg_label, seq_length):
    samples = [np.array(pos), np.array(neg), np.array(pos_label), np.array(neg_label)]
    for i in range(len(samples)):
        if len(samples[i]) < (seq_length + 1):
            if (i == 2) or (i == 3):
                # Labels... So pad with -100
                samples[i] = np.pad(
                    samples[i], (0, (seq_length + 1) - len(samples[i])), mode="constant", constant_values=-100
                )
            else:
                # Pad with 0s, can use any number since it's masked.
                samples[i] = np.pad(
                    samples[i], (0, (seq_length + 1) - len(samples[i])), mode="constant", constant_values=0
                )
        elif len(samples[i]) > (seq_length + 1):
            samples[i] = samples[i][: (seq_length + 1)]
    return {
        "pos": np.array(samples[0], dtype=np.int64),
        "neg": np.array(samples[1], dtype=np.int64),
        "pos_label": np.array(samples[2], dtype=np.int64),
        "neg_label": np.array(samples[3], dtype=np.int64),
    }


# ---------------------------------------------------------------------------------------------------------------
# megatron/utils.py, megatron/training.py
# ---------------------------------------------------------------------------------------------------------------
def get_attn_mask(seq_length, device, sliding_window_width=None):
    mask = torch.tril(torch.ones((1, seq_length, seq_length), device=device)).view(1, 1, seq_length, seq_length)
    if sliding_window_width is not None:
        mask = torch.triu(mask, diagonal=-sliding_window_width)
    return mask < 0.5


def get_ltor_masks_and_position_ids(data, eod_token, eod_mask_loss=False, sliding_window_width=None):
    batch_size, seq_length = data.size()
    attention_mask = get_attn_mask(seq_length=seq_length, device=data.device, sliding_window_width=sliding_window_width)
    loss_mask = torch.ones(data.size(), dtype=torch.float, device=data.device)
    if eod_mask_loss:
        loss_mask[data == eod_token] = 0.0
    position_ids = torch.arange(seq_length, dtype=torch.long, device=data.device)
    position_ids = position_ids.unsqueeze(0).expand_as(data)
    return attention_mask, loss_mask, position_ids


def _get_batch(data_b, keys, eod_token):
    token_key = keys[0]
    label_key = keys[1] if len(keys) > 1 else None
    tokens_ = data_b[token_key].long()
    if label_key in data_b:
        label_mask = (data_b[label_key].long() >= 0)[:, 1:].contiguous()
        labels = torch.where(
            data_b[label_key].long() >= 0, data_b[label_key].long(), torch.zeros_like(data_b[label_key].long())
        )[:, 1:].contiguous()
    else:
        label_mask = (tokens_.long() >= 0)[:, 1:].contiguous()
        labels = tokens_[:, 1:].contiguous()
    tokens = tokens_[:, :-1].contiguous()
    attention_mask, loss_mask, position_ids = get_ltor_masks_and_position_ids(data=tokens, eod_token=eod_token)
    loss_mask = label_mask.to(loss_mask.dtype) * loss_mask
    return tokens, labels, loss_mask, attention_mask, position_ids


def get_batch(data, eod_token):
    keys = [["pos", "pos_label"], ["neg", "neg_label"]]
    pos_tup = _get_batch(data, keys[0], eod_token)
    neg_tup = _get_batch(data, keys[1], eod_token)
    return [torch.cat((p, n), dim=0) for p, n in zip(pos_tup, neg_tup)]


class RewardModelPipe(nn.Module):
    """GPT-NeoX trunk + ParallelLinear's rm_linear (hidden_size -> 1, no bias)."""

    def __init__(self, config):
        super().__init__()
        self.gpt_neox = GPTNeoXModel(config)
        self.rm_linear = nn.Linear(config.hidden_size, 1, bias=False)

    def forward(self, args):
        tokens, position_ids, attention_mask = args
        # megatron's fused softmax applies its lower-triangular `attention_mask` (True = masked); the HF trunk
        # builds the same causal mask itself from position_ids.
        hidden = self.gpt_neox(input_ids=tokens, position_ids=position_ids).last_hidden_state
        return self.rm_linear(hidden)


def forward_step(model, data, eod_token, z_loss=0.0):
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data, eod_token)
    metrics = {}
    maybe_tuple = model((tokens, position_ids, attention_mask))
    if type(maybe_tuple) is tuple:
        outputs, _ = maybe_tuple
    else:
        outputs = maybe_tuple
    pos, neg = torch.chunk(outputs, 2, 0)
    pos_loss_mask, neg_loss_mask = torch.chunk(loss_mask, 2, 0)
    # We assume that each pos, neg pair occur in the same order
    pos_indx = pos_loss_mask.nonzero()
    neg_indx = neg_loss_mask.nonzero()
    pos_indx = pos_indx[:, 1].unsqueeze(1)
    neg_indx = neg_indx[:, 1].unsqueeze(1)
    pos = torch.gather(pos.squeeze(), dim=1, index=pos_indx)
    neg = torch.gather(neg.squeeze(), dim=1, index=neg_indx)
    with torch.no_grad():
        metrics["pos_values"] = pos.clone().detach().mean()
        metrics["neg_values"] = neg.clone().detach().mean()
        metrics["margin"] = (pos - neg).clone().detach().mean()
        metrics["accuracy"] = ((pos - neg) > 0).clone().detach().float().mean()
    loss = (-F.logsigmoid(pos - neg).mean()) + ((z_loss * (pos**2 + neg**2)).mean())
    return loss, metrics, pos_indx, neg_indx


def main():
    pairs = [
        (
            [{"role": "user", "content": "what is two plus three ?"}, {"role": "assistant", "content": "five ."}],
            [{"role": "user", "content": "what is two plus three ?"}, {"role": "assistant", "content": "i think six ."}],
        ),
        (
            [{"role": "user", "content": "name a colour ."}, {"role": "assistant", "content": "it is blue ."}],
            [{"role": "user", "content": "name a colour ."}, {"role": "assistant", "content": "maybe red ?"}],
        ),
    ]
    seq_length = 32
    items = []
    for chosen, rejected in pairs:
        pos, pos_label = build_chat(chosen, "assistant", True, tokenizer, for_rm=True)
        neg, neg_label = build_chat(rejected, "assistant", True, tokenizer, for_rm=True)
        items.append(pairwise_item(pos, neg, pos_label, neg_label, seq_length))
    data = {k: torch.tensor(np.stack([it[k] for it in items])) for k in items[0]}

    config = GPTNeoXConfig(
        vocab_size=len(WORDS), hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        max_position_embeddings=64, rotary_pct=0.25, attn_implementation="eager",
    )
    model = RewardModelPipe(config).eval()
    with torch.no_grad():
        loss, metrics, pos_indx, neg_indx = forward_step(model, data, tokenizer.eos_token_id)
    tokens = data["pos"][:, :-1]
    read = [WORDS[tokens[b, pos_indx[b, 0]].item()] for b in range(tokens.shape[0])]
    print("reward read at positions", pos_indx.squeeze(1).tolist(), neg_indx.squeeze(1).tolist(), "tokens", read)
    print("loss %.6f" % loss.item(), {k: round(v.item(), 6) for k, v in metrics.items()})


if __name__ == "__main__":
    main()

"""torchtitan SFT: the block-causal document mask looks for EOS tokens that packing never put in the inputs.

Citation: pytorch/torchtitan#3130 ("SFT eot_id and causality bugs"), fixed by pytorch/torchtitan#3149
(commit 2c237aef3, "refactor get_attention_masks to use positions instead of eos_id").

Bug: ``ChatDataset._tokenize_sample`` returns ``input_ids = full_tokens[:-1]`` so each conversation's EOS
lives only in the labels, and ``_iter_greedy_packed`` concatenates the input_ids of several
conversations (with per-document ``positions`` restarting at 0). ``Decoder.get_attention_masks`` then
builds the block-causal FlexAttention mask with ``get_document_mask_mod(input_batch, tokenizer.eos_id)``,
which splits documents after EOS tokens: there are none between packed conversations, so the second
conversation attends the first.
Fix: ``get_document_mask_mod(positions)``: document ids from ``cumsum(positions == 0) - 1``.

This program: a toy tokenizer, the packing loop as the project wrote it (seq_len 16, two conversations of
6 and 4 input tokens, EOS padding at the end), and one FlexAttention layer (eager ``create_block_mask``
+ ``flex_attention``) over the packed row with ``mask_type = "block_causal"``.
"""
import sys
import warnings
from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import and_masks, create_block_mask, flex_attention

FIXED = "--fixed" in sys.argv
IGNORE_INDEX = -100
warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")


class ToyTokenizer:
    bos_id, eos_id = 1, 2

    def apply_chat_template(self, messages, add_generation_prompt=False):
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "<eos>")

    def encode(self, text, add_bos=True, add_eos=False):
        ids = [self.bos_id] if add_bos else []
        for word in text.replace("<eos>", " <eos> ").replace(">", "> ").split():
            ids.append(self.eos_id if word == "<eos>" else 3 + sum(map(ord, word)) % 60)
        return ids + ([self.eos_id] if add_eos else [])


class ChatDataset:
    def __init__(self, samples, tokenizer, seq_len):
        self._data, self._tokenizer, self.seq_len = samples, tokenizer, seq_len
        self._eos_id = tokenizer.eos_id
        self._inputs_buffer, self._labels_buffer, self._positions_buffer = [], [], []

    def _tokenize_sample(self, messages):
        full_text = self._tokenizer.apply_chat_template(messages).rstrip("\n")
        full_tokens = self._tokenizer.encode(full_text, add_bos=True, add_eos=False)
        if full_tokens[-1] != self._eos_id:
            full_tokens.append(self._eos_id)
        input_ids = full_tokens[:-1]
        label_ids = full_tokens[1:]
        prompt_text = self._tokenizer.apply_chat_template(messages[:1], add_generation_prompt=True)
        prompt_len = len(self._tokenizer.encode(prompt_text, add_bos=True, add_eos=False))
        mask_end = min(max(prompt_len - 1, 0), len(label_ids))
        label_ids[:mask_end] = [IGNORE_INDEX] * mask_end
        return input_ids, label_ids

    def __iter__(self):
        for sample in self._data:
            input_ids, label_ids = self._tokenize_sample(sample)
            # Add example to buffer with positions resetting to 0
            self._inputs_buffer.extend(input_ids)
            self._labels_buffer.extend(label_ids)
            self._positions_buffer.extend(range(len(input_ids)))
        pad_len = self.seq_len - len(self._inputs_buffer)
        self._inputs_buffer.extend([self._eos_id] * pad_len)
        self._labels_buffer.extend([IGNORE_INDEX] * pad_len)
        self._positions_buffer.extend(range(pad_len))
        yield {
            "input": torch.tensor(self._inputs_buffer),
            "positions": torch.tensor(self._positions_buffer),
        }, torch.tensor(self._labels_buffer)


def get_causal_mask_mod():
    def _causal_mask(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    return _causal_mask


if FIXED:

    def get_document_mask_mod(positions):
        doc_ids = torch.cumsum((positions == 0).int(), dim=1) - 1

        def document_mask(b, h, q_idx, kv_idx):
            return doc_ids[b, q_idx] == doc_ids[b, kv_idx]

        return document_mask

else:

    def get_document_mask_mod(batch, eos_id):
        eos_mask = batch == eos_id
        eos_mask[:, -1] = True
        cumulative_mask = torch.cumsum(torch.where(eos_mask, 1, 0), dim=1)
        sequence_indices = torch.zeros_like(cumulative_mask, dtype=torch.int32)
        sequence_indices[:, 1:] = cumulative_mask[:, :-1]

        def document_mask(b, h, q_idx, kv_idx):
            return sequence_indices[b, q_idx] == sequence_indices[b, kv_idx]

        return document_mask


@dataclass
class AttentionConfig:
    mask_type: str = "block_causal"
    n_heads: int = 2
    head_dim: int = 8


class Decoder(torch.nn.Module):
    def __init__(self, config: AttentionConfig, vocab_size=64):
        super().__init__()
        self.config = config
        dim = config.n_heads * config.head_dim
        self.tok_embeddings = torch.nn.Embedding(vocab_size, dim)
        self.wqkv = torch.nn.Linear(dim, 3 * dim, bias=False)

    def get_attention_masks(self, input_batch, tokenizer=None, positions=None):
        mask_mods = [get_causal_mask_mod()]
        match self.config.mask_type:
            case "causal":
                B = 1
            case "block_causal":
                B = input_batch.shape[0]
                if FIXED:
                    mask_mods.append(get_document_mask_mod(positions))
                else:
                    assert tokenizer.eos_id is not None
                    mask_mods.append(get_document_mask_mod(input_batch, tokenizer.eos_id))
        seq_len = input_batch.shape[1]
        return create_block_mask(and_masks(*mask_mods), B, None, seq_len, seq_len, device="cpu")

    def forward(self, tokens, attention_masks):
        bs, seqlen = tokens.shape
        h = self.tok_embeddings(tokens)
        q, k, v = self.wqkv(h).view(bs, seqlen, 3, self.config.n_heads, -1).permute(2, 0, 3, 1, 4)
        return flex_attention(q, k, v, block_mask=attention_masks)


def main():
    torch.manual_seed(0)
    tokenizer = ToyTokenizer()
    samples = [
        [{"role": "user", "content": "two plus two"}, {"role": "assistant", "content": "four"}],
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
    ]
    (inputs, labels) = next(iter(ChatDataset(samples, tokenizer, seq_len=16)))
    input_batch, positions = inputs["input"][None], inputs["positions"][None]
    model = Decoder(AttentionConfig())
    masks = model.get_attention_masks(input_batch, tokenizer, positions=positions)
    with torch.no_grad():
        out = model(input_batch, masks)
    print("positions", positions.tolist()[0], "out norm %.4f" % out.norm())


if __name__ == "__main__":
    main()

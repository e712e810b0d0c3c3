# ms-swift, modelscope/ms-swift#5751 ("set default padding side to left for generative reranker").
# In training Template._pad_sequence right-pads (template padding_side='right'), but generative_reranker_loss reads
# logits[:, -1], so shorter query/document pairs are scored from a pad position instead of their last real token.
import sys

import torch
import torch.nn.functional as F
from torch.nn import CrossEntropyLoss
from torch.nn.utils.rnn import pad_sequence
from transformers import Qwen2Config, Qwen2ForCausalLM

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
PAD_ID, YES_ID, NO_ID = 0, 5, 6


class Template:
    """swift/llm/template/base.py (pieces used by the reranker collator)."""

    def __init__(self, task_type='generative_reranker', padding_side='right'):
        self.task_type = task_type
        self.padding_side = padding_side
        self.is_training = True
        self.padding_free = False
        self.use_megatron = False

    def _pad_sequence(self, sequences, padding_value=0.):
        if FIXED:
            padding_side = self.padding_side if self.is_training and self.task_type != 'generative_reranker' else 'left'
        else:
            padding_side = self.padding_side if self.is_training else 'left'
        padding_right = padding_side == 'right'
        if padding_right:
            return pad_sequence(sequences, batch_first=True, padding_value=padding_value)

        max_len = max([s.shape[0] for s in sequences])
        padded_sequences = []
        for seq in sequences:
            pad_length = max_len - seq.shape[0]
            pad_tuple = [0] * ((seq.dim() - 1) * 2) + [pad_length, 0]
            padded_seq = F.pad(seq, tuple(pad_tuple), 'constant', padding_value)
            padded_sequences.append(padded_seq)
        return torch.stack(padded_sequences)

    def _data_collator(self, batch, *, padding_to=None):
        res = {}
        res['input_ids'] = [b['input_ids'] for b in batch]
        keys = ['input_ids', 'attention_mask', 'position_ids']
        pad_values = [PAD_ID, 0, 0]
        seq_lens = None
        for key in keys:
            if key not in res:
                continue
            for i, val in enumerate(res[key]):
                if isinstance(val, (list, tuple)):
                    val = torch.tensor(val)
                res[key][i] = val
            if not seq_lens:
                seq_lens = [seq.shape[0] for seq in res[key]]
        if seq_lens and 'input_ids' in res:
            res['attention_mask'] = [torch.ones(seq_len, dtype=torch.int64) for seq_len in seq_lens]
            if self.is_training and self.padding_side == 'left':
                res['position_ids'] = [torch.arange(seq_len, dtype=torch.int64) for seq_len in seq_lens]
        for key, pad_value in zip(keys, pad_values):
            if key not in res:
                continue
            res[key] = self._pad_sequence(res[key], pad_value)
        return res

    def _reranker_data_collator(self, batch, *, padding_to=None):
        max_negative_samples = 7
        labels = []
        new_batch = []
        for b in batch:
            new_batch.append({'input_ids': b['positive_input_ids']})
            for neg in b['negative_input_ids'][:max_negative_samples]:
                new_batch.append({'input_ids': neg})
            labels.extend(b['labels'][:max_negative_samples + 1])
        res = self._data_collator(new_batch, padding_to=padding_to)
        if labels:
            res['labels'] = torch.tensor(labels, dtype=torch.long)
        return res


def generative_reranker_loss(outputs, labels, loss_scale=None, num_items_in_batch=None, trainer=None, **kwargs):
    """swift/plugin/loss.py"""
    logits = outputs.logits
    positive_token_id, negative_token_id = YES_ID, NO_ID
    # Extract logits for positive and negative tokens directly from last position
    positive_logits = logits[:, -1, positive_token_id]  # [batch_size]
    negative_logits = logits[:, -1, negative_token_id]  # [batch_size]
    binary_logits = torch.stack([negative_logits, positive_logits], dim=1)
    binary_labels = labels.to(binary_logits.device).long()
    loss_fct = CrossEntropyLoss()
    loss = loss_fct(binary_logits, binary_labels)
    return loss, binary_logits


class RerankerTrainer:
    """swift/trainers/trainers.py compute_loss with compute_loss_func=generative_reranker_loss."""

    def __init__(self, model):
        self.model = model
        self.compute_loss_func = generative_reranker_loss

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.pop('labels')
        outputs = model(**inputs)
        return self.compute_loss_func(outputs, labels, num_items_in_batch=num_items_in_batch, trainer=self)


cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  pad_token_id=PAD_ID, attn_implementation="sdpa")
model = Qwen2ForCausalLM(cfg).eval()
template = Template()
trainer = RerankerTrainer(model)


def pair(n):  # "<query><document> ... Answer:" already encoded, ends in the slot where yes/no is predicted
    return torch.randint(7, 64, (n,))


batch = [
    {'positive_input_ids': pair(12), 'negative_input_ids': [pair(7), pair(15)], 'labels': [1, 0, 0]},
    {'positive_input_ids': pair(9), 'negative_input_ids': [pair(15), pair(4)], 'labels': [1, 0, 0]},
]

with torch.no_grad():
    inputs = template._reranker_data_collator(batch)
    loss, binary_logits = trainer.compute_loss(model, inputs)
    # reference: every pair scored alone (no padding), yes/no logits at its last token
    ref = []
    for b in batch:
        for ids in [b['positive_input_ids']] + b['negative_input_ids']:
            lg = model(input_ids=ids[None]).logits[0, -1]
            ref.append(torch.stack([lg[NO_ID], lg[YES_ID]]))
    ref = torch.stack(ref)
    ref_loss = CrossEntropyLoss()(ref, torch.tensor([l for b in batch for l in b['labels']]))

print(f"reranker loss batched {loss.item():.5f} vs pairs alone {ref_loss.item():.5f}")
print(f"max |batched - alone| yes/no logits: {(binary_logits - ref).abs().max().item():.6f}")

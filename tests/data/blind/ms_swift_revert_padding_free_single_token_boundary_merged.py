# ms-swift (modelscope/ms-swift#9903, fixed on main by #9924; the fixed lines here follow the maintainer's account
# in #9903, the #9924 diff was not read): embedding training with padding_free packs every sentence into one row and
# swift/model/utils.py revert_padding_free rebuilds the padded batch and its attention_mask from position_ids before
# the output-normalizer hook pools the last valid token. Sequence starts were found with `pos[1:] < pos[:-1]`, so a
# one-token sentence followed by another sentence (positions ... 0, 0, 1 ...) is not split and two sentences become
# one row of the rebuilt mask. The fix tests `<=` (plus `>= 0` for the -1 padding of sequence parallel) and counts the
# last segment by its valid tokens.
import sys
from types import MethodType
from typing import Any, Dict

import torch
import torch.nn.functional as F
from transformers import Qwen2Config, Qwen2ForCausalLM

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def get_last_valid_indices(attention_mask: torch.Tensor) -> torch.Tensor:
    seq_len = attention_mask.shape[1]
    last_valid_indices = torch.fliplr(attention_mask).argmax(dim=1)
    indices = seq_len - 1 - last_valid_indices
    return indices


def patch_output_normalizer(module: torch.nn.Module):

    def lm_head_forward(self, hidden_states):
        return hidden_states

    lm_heads = ['lm_head', 'output', 'embed_out', 'output_layer']
    lm_head_model = module
    found = False
    for lm_head in lm_heads:
        if hasattr(lm_head_model, lm_head):
            getattr(lm_head_model, lm_head).forward = MethodType(lm_head_forward, getattr(lm_head_model, lm_head))
            found = True
            break

    assert found, 'Cannot find the proper lm_head name'

    def _output_embedding_hook(module, args, kwargs, output):
        attention_mask = kwargs.get('attention_mask', None)
        hidden_states = output.logits
        sequence_lengths = -1 if attention_mask is None else get_last_valid_indices(attention_mask)
        embeddings = hidden_states[torch.arange(hidden_states.shape[0], device=hidden_states.device), sequence_lengths]
        embeddings = F.normalize(embeddings, p=2, dim=1)
        return {'last_hidden_state': embeddings.contiguous()}

    lm_head_model.register_forward_hook(_output_embedding_hook, with_kwargs=True)


def revert_padding_free(outputs: Dict[str, Any], inputs: Dict[str, Any], padding_side='left'):
    hidden_state_key = None
    if 'last_hidden_state' in outputs:
        hidden_state_key = 'last_hidden_state'
    elif 'logits' in outputs:
        hidden_state_key = 'logits'
    elif 'token_embeddings' in outputs:
        hidden_state_key = 'token_embeddings'

    if hidden_state_key is None:
        raise NotImplementedError()
    last_hidden_state = outputs[hidden_state_key]
    last_hidden_state = last_hidden_state.squeeze(dim=0)
    if 'position_ids' in inputs and inputs['position_ids'].shape[0] == 1:
        position_ids = inputs['position_ids']
    else:
        raise ValueError("revert_padding_free requires 'position_ids' in inputs.")

    seq_lengths = []
    pos = position_ids[0]
    if FIXED:
        resets = torch.where((pos[1:] <= pos[:-1]) & (pos[1:] >= 0))[0] + 1
    else:
        resets = torch.where(pos[1:] < pos[:-1])[0] + 1

    if len(resets) == 0:
        # Only one sequence in this batch item
        seq_lengths = [pos.max().item() + 1]
    else:
        # Multiple sequences
        start = 0
        for end in resets:
            seq_lengths.append(end - start)
            start = end
        if FIXED:
            seq_lengths.append(int((pos[start:] >= 0).sum()))
        else:
            seq_lengths.append(pos.shape[0] - start)

    max_length = max(seq_lengths)
    unpacked_logits = []
    attention_mask = []

    start = 0
    for length in seq_lengths:
        seq_state = last_hidden_state[start:start + length]
        mask = torch.ones((seq_state.shape[0])).to(last_hidden_state.device)
        padding = torch.zeros(
            (max_length - length, last_hidden_state.shape[-1])).to(last_hidden_state.dtype).to(last_hidden_state.device)
        attention_padding = torch.zeros((max_length - length)).to(last_hidden_state.device)
        # re-padding
        if padding_side == 'left':
            seq_state = torch.cat((padding, seq_state), dim=0)
            mask = torch.cat((attention_padding, mask), dim=0)
        else:
            seq_state = torch.cat((seq_state, padding), dim=0)
            mask = torch.cat((mask, attention_padding), dim=0)
        unpacked_logits.append(seq_state)
        attention_mask.append(mask)
        start += length
    outputs[hidden_state_key] = torch.stack(unpacked_logits, dim=0)
    inputs['attention_mask'] = torch.stack(attention_mask, dim=0).to(torch.int64)
    outputs['attention_mask'] = inputs['attention_mask']
    return outputs


def padding_free_collate(batch):
    # Template._data_collator with padding_free: one row, position_ids restart at 0 for every sentence
    input_ids, position_ids = [], []
    for ids in batch:
        input_ids += ids
        position_ids += list(range(len(ids)))
    return {
        'input_ids': torch.tensor([input_ids]),
        'position_ids': torch.tensor([position_ids]),
    }


def infonce_loss(outputs, temperature=0.1):
    # anchor / positive pairs: sentences 0, 2, ... are queries, 1, 3, ... their positives
    sentences = outputs['last_hidden_state']
    anchors, positives = sentences[0::2], sentences[1::2]
    n = min(anchors.shape[0], positives.shape[0])
    sim = anchors[:n] @ positives[:n].T / temperature
    labels = torch.arange(n)
    return F.cross_entropy(sim, labels)


config = Qwen2Config(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, tie_word_embeddings=False,
    use_cache=False)
config._attn_implementation = 'sdpa'
model = Qwen2ForCausalLM(config).eval()

padding_side = 'right'
patch_output_normalizer(model)


def revert_padding_free_hook(module, args, input, output):
    return revert_padding_free(output, input, padding_side)


model.register_forward_hook(revert_padding_free_hook, with_kwargs=True, prepend=True)

# query, document, query, document; the queries are single tokens (a one-word search)
batch = [[17], [5, 23, 41], [88], [9, 60, 31, 12]]
inputs = padding_free_collate(batch)
with torch.no_grad():
    outputs = model(**inputs)

print('embeddings:', tuple(outputs['last_hidden_state'].shape))
print('infonce loss: %.6f' % infonce_loss(outputs).item())

# ms-swift (modelscope/ms-swift#7007, commit bad38d796): transformers_seq_cls_forward pools the score of a patched
# causal-LM classifier at `attention_mask.sum(dim=1) - 1` when called with inputs_embeds (multimodal); on a left-padded
# batch that is not the last real token. The fix uses get_last_valid_indices(attention_mask) (rightmost 1).
import sys
from functools import wraps
from types import MethodType

import torch
import torch.nn as nn
from transformers import Qwen2Config, Qwen2ForCausalLM
from transformers.modeling_outputs import SequenceClassifierOutputWithPast

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def get_last_valid_indices(attention_mask: torch.Tensor) -> torch.Tensor:
    """Last valid (non-padding) index per sample, for left, right or no padding."""
    seq_len = attention_mask.shape[1]
    flipped = attention_mask.flip(dims=[1])
    return seq_len - 1 - flipped.int().argmax(dim=1)


def transformers_seq_cls_forward(self, *args, origin_forward, padding_side=None, **kwargs):
    labels = kwargs.pop('labels', None)
    return_dict = kwargs.pop('return_dict', None)
    return_dict = return_dict if return_dict is not None else True
    input_ids = kwargs.get('input_ids')
    inputs_embeds = kwargs.get('inputs_embeds')

    output = origin_forward(*args, **kwargs)
    if hasattr(output, 'logits'):
        output.logits = output.logits.to(self.score.weight.dtype)
    elif 'last_hidden_state' in output:
        output.logits = output['last_hidden_state'].to(self.score.weight.dtype)
    logits = self.score(output.logits)
    if input_ids is not None:
        batch_size = input_ids.shape[0]
    else:
        batch_size = inputs_embeds.shape[0]

    if padding_side == 'left':
        pooled_logits = logits[:, -1]
    else:
        if self.config.pad_token_id is None and batch_size != 1:
            raise ValueError('Cannot handle batch sizes > 1 if no padding token is defined.')
        if self.config.pad_token_id is None:
            sequence_lengths = -1
        else:
            if output.get('attention_mask') is not None:
                # When use padding_free in seq_cls tasks, `revert_padding_free` will add a attention_mask in the output
                batch_size = output.get('attention_mask').shape[0]
                sequence_lengths = output.get('attention_mask').sum(dim=1) - 1
            elif input_ids is not None:
                # if no pad token found, use modulo instead of reverse indexing for ONNX compatibility
                sequence_lengths = torch.eq(input_ids, self.config.pad_token_id).int().argmax(-1) - 1
                sequence_lengths = sequence_lengths % input_ids.shape[-1]
            elif kwargs.get('attention_mask') is not None:
                if FIXED:
                    sequence_lengths = get_last_valid_indices(kwargs['attention_mask'])
                else:
                    sequence_lengths = kwargs['attention_mask'].sum(dim=1) - 1
            else:
                sequence_lengths = -1
        if isinstance(sequence_lengths, torch.Tensor):
            sequence_lengths = sequence_lengths.to(logits.device)

        pooled_logits = logits[torch.arange(batch_size, device=logits.device), sequence_lengths]

    loss = None
    return SequenceClassifierOutputWithPast(loss=loss, logits=pooled_logits, past_key_values=output.past_key_values)


def _patch_sequence_classification(model, num_labels, initializer_range):
    lm_heads = ['lm_head', 'output', 'embed_out', 'output_layer']
    llm_model = model
    llm_model.num_labels = num_labels
    for lm_head in lm_heads:
        if hasattr(llm_model, lm_head):
            hidden_size = getattr(llm_model, lm_head).in_features
            setattr(llm_model, lm_head, nn.Identity())
            break
    llm_model.score = nn.Linear(hidden_size, llm_model.num_labels, bias=False, dtype=llm_model.dtype)
    llm_model.score.weight.data.normal_(mean=0.0, std=initializer_range)

    origin_forward = llm_model.forward

    @wraps(origin_forward.__func__)
    def new_forward(self, *args, **kwargs):
        return transformers_seq_cls_forward(self, *args, origin_forward=origin_forward, **kwargs)

    llm_model.forward = MethodType(new_forward, llm_model)


PAD = 0
config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=64, pad_token_id=PAD, tie_word_embeddings=False,
                     initializer_range=0.2)
config._attn_implementation = "sdpa"
model = Qwen2ForCausalLM(config).eval()
_patch_sequence_classification(model, num_labels=2, initializer_range=0.2)

# Template batch for inference/eval: left padding; a multimodal template hands the model inputs_embeds
samples = [[5, 17, 33, 8, 21, 40, 9], [12, 7, 50], [3, 44, 19, 26, 2]]
max_len = max(len(s) for s in samples)
input_ids = torch.tensor([[PAD] * (max_len - len(s)) + s for s in samples])
attention_mask = torch.tensor([[0] * (max_len - len(s)) + [1] * len(s) for s in samples])
position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
inputs_embeds = model.get_input_embeddings()(input_ids)

with torch.no_grad():
    batched = model(inputs_embeds=inputs_embeds, attention_mask=attention_mask, position_ids=position_ids).logits
    max_diff = 0.0
    for i, s in enumerate(samples):
        ids = torch.tensor([s])
        emb = model.get_input_embeddings()(ids)
        alone = model(inputs_embeds=emb, attention_mask=torch.ones_like(ids)).logits
        max_diff = max(max_diff, (batched[i] - alone[0]).abs().max().item())
print(f"max |seq_cls logits (left-padded inputs_embeds batch) - (sample alone)| = {max_diff:.6f}")

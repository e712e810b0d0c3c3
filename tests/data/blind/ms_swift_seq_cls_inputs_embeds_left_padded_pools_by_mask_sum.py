"""ms-swift reranker / seq_cls head patched onto a causal LM: the pooled position on the inputs_embeds path.

Citation: modelscope/ms-swift#7007 (commit bad38d796, "[bugfix] fix reranker padding_free & fix seq_cls
omni padding_free"), swift/llm/model/patcher.py ``transformers_seq_cls_forward``.

ms-swift turns a causal LM into a reranker (task_type='reranker', one score per query/document pair) by
``_patch_sequence_classification``: the lm_head becomes ``nn.Identity()``, a ``score`` Linear is added, and
the LM's forward is wrapped by ``transformers_seq_cls_forward`` (called there without ``padding_side``).
Multimodal templates call the model with ``inputs_embeds`` (no ``input_ids``), so the pooled position comes
from the attention mask. Reranker batches are left-padded (ms-swift's default for rerankers).

The bug: ``sequence_lengths = kwargs['attention_mask'].sum(dim=1) - 1``, the count of real tokens minus one,
which is the last real token only for right padding.
The fix: ``sequence_lengths = get_last_valid_indices(kwargs['attention_mask'])`` (the last column whose
mask is 1, found on the flipped mask).

Toy sizes, random weights: a 2-layer Qwen2 built from its config, three query/document pairs of different
lengths, left-padded.
"""

import sys
from functools import wraps
from types import MethodType

import torch
from torch import nn
from torch.nn import BCEWithLogitsLoss, CrossEntropyLoss, MSELoss
from transformers import Qwen2Config, Qwen2ForCausalLM
from transformers.modeling_outputs import SequenceClassifierOutputWithPast

FIXED = "--fixed" in sys.argv


def get_last_valid_indices(attention_mask: torch.Tensor) -> torch.Tensor:
    seq_len = attention_mask.shape[1]
    last_valid_indices = torch.fliplr(attention_mask).argmax(dim=1)
    indices = seq_len - 1 - last_valid_indices
    return indices


def transformers_seq_cls_forward(self, *args, origin_forward, padding_side=None, **kwargs):
    labels = kwargs.pop('labels', None)
    return_dict = kwargs.pop('return_dict', None)
    return_dict = return_dict if return_dict is not None else self.config.use_return_dict
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
    if labels is not None:
        labels = labels.to(logits.device)
        if self.config.problem_type is None:
            if self.num_labels == 1:
                self.config.problem_type = 'regression'
            elif self.num_labels > 1 and (labels.dtype == torch.long or labels.dtype == torch.int):
                self.config.problem_type = 'single_label_classification'
            else:
                self.config.problem_type = 'multi_label_classification'

        if self.config.problem_type == 'regression':
            loss_fct = MSELoss()
            if self.num_labels == 1:
                loss = loss_fct(pooled_logits.squeeze(), labels.squeeze())
            else:
                loss = loss_fct(pooled_logits, labels)
        elif self.config.problem_type == 'single_label_classification':
            loss_fct = CrossEntropyLoss()
            loss = loss_fct(pooled_logits.view(-1, self.num_labels), labels.view(-1))
        elif self.config.problem_type == 'multi_label_classification':
            loss_fct = BCEWithLogitsLoss()
            loss = loss_fct(pooled_logits, labels)
    if not return_dict:
        output = (pooled_logits, ) + output[1:]
        return ((loss, ) + output) if loss is not None else output

    return SequenceClassifierOutputWithPast(
        loss=loss,
        logits=pooled_logits,
        past_key_values=output.past_key_values,
        hidden_states=output.hidden_states,
        attentions=output.attentions,
    )


def _patch_sequence_classification(model):
    hidden_size = model.config.hidden_size
    initializer_range = model.config.initializer_range

    lm_heads = ['lm_head', 'output', 'embed_out', 'output_layer']
    llm_model = model
    llm_model.num_labels = model.config.num_labels
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


def left_pad(seqs, pad_token_id):
    max_len = max(len(s) for s in seqs)
    input_ids = torch.full((len(seqs), max_len), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(seqs), max_len), dtype=torch.long)
    for i, s in enumerate(seqs):
        input_ids[i, max_len - len(s):] = torch.tensor(s)
        attention_mask[i, max_len - len(s):] = 1
    return input_ids, attention_mask


def main():
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, num_labels=1,
        initializer_range=0.2)
    config._attn_implementation = 'sdpa'
    model = Qwen2ForCausalLM(config).eval()
    _patch_sequence_classification(model)

    g = torch.Generator().manual_seed(1)
    # query + document pairs of different lengths (the template's rendering, ids only)
    pairs = [torch.randint(1, 128, (n, ), generator=g).tolist() for n in (9, 5, 7)]
    input_ids, attention_mask = left_pad(pairs, config.pad_token_id)
    labels = torch.tensor([1.0, 0.0, 0.0])

    # multimodal templates hand the model inputs_embeds (after _post_encode), not input_ids
    inputs_embeds = model.get_input_embeddings()(input_ids)
    with torch.no_grad():
        out = model(inputs_embeds=inputs_embeds, attention_mask=attention_mask, labels=labels)
    print('attention_mask:', attention_mask.tolist())
    print('reranker scores:', [round(v, 4) for v in out.logits.squeeze(-1).tolist()])
    print('loss:', round(out.loss.item(), 4))


if __name__ == '__main__':
    main()

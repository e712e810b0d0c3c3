# amazon-science/chronos-forecasting#227 (commit 67f0084): left_pad_and_stack_1D padded with NaN and then cast back with
# `.to(tensors[0])`; for integer series the NaN padding became integers, so `attention_mask = ~isnan(context)` was all
# True and the T5 encoder attended to the left padding. The fix keeps the stacked tensor float.
import sys
from typing import List

import torch
from transformers import T5Config, T5ForConditionalGeneration

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def left_pad_and_stack_1D(tensors: List[torch.Tensor]) -> torch.Tensor:
    max_len = max(len(c) for c in tensors)
    padded = []
    for c in tensors:
        padding = torch.full(size=(max_len - len(c),), fill_value=torch.nan, device=c.device)
        padded.append(torch.concat((padding, c), dim=-1))
    if FIXED:
        return torch.stack(padded)
    return torch.stack(padded).to(tensors[0])


class MeanScaleUniformBins:
    def __init__(self, n_tokens=64, n_special_tokens=2, pad_token_id=0, eos_token_id=1, low=-15.0, high=15.0):
        self.n_tokens, self.n_special_tokens = n_tokens, n_special_tokens
        self.pad_token_id, self.eos_token_id = pad_token_id, eos_token_id
        centers = torch.linspace(low, high, n_tokens - n_special_tokens - 1)
        self.boundaries = torch.concat((torch.tensor([-1e20]), (centers[1:] + centers[:-1]) / 2, torch.tensor([1e20])))

    def _input_transform(self, context, scale=None):
        context = context.to(dtype=torch.float32)
        attention_mask = ~torch.isnan(context)
        if scale is None:
            scale = torch.nansum(torch.abs(context) * attention_mask, dim=-1) / torch.nansum(attention_mask, dim=-1)
            scale[~(scale > 0)] = 1.0
        scaled_context = context / scale.unsqueeze(dim=-1)
        token_ids = torch.bucketize(input=scaled_context, boundaries=self.boundaries, right=True) + self.n_special_tokens
        token_ids.clamp_(0, self.n_tokens - 1)
        token_ids[~attention_mask] = self.pad_token_id
        return token_ids, attention_mask, scale

    def context_input_transform(self, context):
        token_ids, attention_mask, scale = self._input_transform(context)
        batch_size = token_ids.shape[0]
        token_ids = torch.concat((token_ids, torch.full((batch_size, 1), self.eos_token_id)), dim=1)
        attention_mask = torch.concat((attention_mask, torch.full((batch_size, 1), True)), dim=1)
        return token_ids, attention_mask, scale


class ChronosPipeline:
    def __init__(self, tokenizer, model):
        self.tokenizer, self.model = tokenizer, model

    def _prepare_and_validate_context(self, context):
        if isinstance(context, list):
            context = left_pad_and_stack_1D(context)
        return context

    @torch.no_grad()
    def next_step_logits(self, context):
        context_tensor = self._prepare_and_validate_context(context)
        token_ids, attention_mask, scale = self.tokenizer.context_input_transform(context_tensor)
        decoder_input_ids = torch.zeros((token_ids.shape[0], 1), dtype=torch.long)  # decoder_start_token_id
        out = self.model(input_ids=token_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids)
        return out.logits[:, -1]


config = T5Config(vocab_size=64, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=2,
                  pad_token_id=0, eos_token_id=1, decoder_start_token_id=0, attn_implementation="eager")
pipeline = ChronosPipeline(MeanScaleUniformBins(), T5ForConditionalGeneration(config).eval())

# A batch of integer-valued series (e.g. daily sales counts) of different lengths -> left padding.
series = [torch.tensor([3, 5, 4, 6, 8, 7, 9, 11, 10, 12]), torch.tensor([20, 22, 19, 25, 24])]
batched = pipeline.next_step_logits(series)
alone = pipeline.next_step_logits([series[1]])  # the short series on its own: no padding at all
print(f"fixed={FIXED}: max |logits(short series in padded batch) - logits(alone)| = "
      f"{(batched[1] - alone[0]).abs().max().item():.3e}")

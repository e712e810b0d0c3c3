"""TransformerLensOrg/TransformerLens#1609, fixed by PR #1610 (merged; final revision cdc2af2).

TransformerBridge.forward() wraps a HuggingFace model (here GPT-2, learned absolute position
embeddings). Handed a left-padded batch and its attention_mask, it passed the mask to the HF model
but no position_ids, so GPT-2 numbered the slots from 0 over the pads: the padded row's real
tokens read shifted position embeddings. No error, just different logits and a different loss.
The fix derives position_ids from the attention mask with utils.get_offset_position_ids (the
helper HookedTransformer's PosEmbed uses), offset by the cached prefix, and passes them on.
"""
import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel

FIXED = "--fixed" in sys.argv


# transformer_lens/utils.py
def get_offset_position_ids(past_kv_pos_offset, attention_mask):
    # shift the position ids so that the id at the the first attended token position becomes zero
    shifted_position_ids = attention_mask.cumsum(dim=1) - 1
    position_ids = shifted_position_ids.masked_fill(shifted_position_ids < 0, 0)
    return position_ids[:, past_kv_pos_offset:]  # keep the last n_new_tokens


class TransformerBridge(torch.nn.Module):
    """Trimmed: the bridge keeps the HF model as `original_model` and forwards to it."""

    def __init__(self, model, cfg):
        super().__init__()
        self.original_model = model
        self.cfg = cfg

    def _accepts_derived_position_ids(self):
        import inspect

        params = inspect.signature(self.original_model.forward).parameters
        return "position_ids" in params

    def forward(self, input, return_type="logits", attention_mask=None, past_key_values=None, **kwargs):
        input_ids = input
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask
        if past_key_values is not None:
            kwargs["past_key_values"] = past_key_values
        if FIXED:
            if (
                attention_mask is not None
                and "position_ids" not in kwargs
                and self._accepts_derived_position_ids()
            ):
                past_kv_pos_offset = attention_mask.shape[1] - input_ids.shape[1]
                kwargs["position_ids"] = get_offset_position_ids(past_kv_pos_offset, attention_mask)
        output = self.original_model(input_ids=input_ids, **kwargs)
        logits = output.logits
        if return_type == "logits":
            return logits
        # loss: next-token cross entropy over attended targets
        log_probs = logits.log_softmax(dim=-1)
        lp = log_probs[:, :-1].gather(-1, input_ids[:, 1:, None])[..., 0]
        mask = attention_mask[:, 1:].to(lp.dtype)
        return -(lp * mask).sum() / mask.sum()


def main():
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                        bos_token_id=0, eos_token_id=0, pad_token_id=0)
    hf = GPT2LMHeadModel(config).eval()
    bridge = TransformerBridge(hf, cfg=config)

    # two prompts, left-padded as the bridge's to_tokens(padding_side="left") lays them out
    prompts = [[0, 11, 23, 5, 42, 7, 19, 3], [0, 31, 8, 14]]
    T = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), T), config.pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), T), dtype=torch.long)
    for i, p in enumerate(prompts):
        input_ids[i, T - len(p):] = torch.tensor(p)
        attention_mask[i, T - len(p):] = 1

    with torch.no_grad():
        logits = bridge(input_ids, attention_mask=attention_mask)
        loss = bridge(input_ids, return_type="loss", attention_mask=attention_mask)
    next_tokens = logits[:, -1].argmax(-1)
    print("last-token logits row 1:", logits[1, -1, :6].tolist())
    print("next tokens:", next_tokens.tolist())
    print("loss:", round(loss.item(), 6))


if __name__ == "__main__":
    main()

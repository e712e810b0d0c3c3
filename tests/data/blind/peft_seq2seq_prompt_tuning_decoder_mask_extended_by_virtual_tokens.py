# Citation: huggingface/peft#809 "FIX: seq2seq prompt tuning (#439)", commit a23b9213f453ef9d72d850e9a28ef740cd5e255a
#           (reported in huggingface/peft#439 and #674).
# Upstream: src/peft/peft_model.py, PeftModelForSeq2SeqLM.forward (prompt tuning / p-tuning path).
# Bug: for every prompt-learning type, forward() prepended `num_virtual_tokens` ones to the
#      *decoder_attention_mask`, although prompt tuning inserts the virtual tokens only in the encoder
#      input. The decoder mask is then longer than the decoder sequence, so the decoder's padding mask is
#      read shifted by num_virtual_tokens positions (padded decoder keys become visible).
# Fix: only concatenate the prefix ones to decoder_attention_mask when peft_type is not
#      PROMPT_TUNING / P_TUNING (i.e. only for prefix tuning, whose keys live in the decoder cache).
import sys
import warnings

import torch
from torch import nn
from transformers import T5Config, T5ForConditionalGeneration

FIXED = "--fixed" in sys.argv

PROMPT_TUNING = "PROMPT_TUNING"
P_TUNING = "P_TUNING"
PREFIX_TUNING = "PREFIX_TUNING"


class PromptTuningConfig:
    def __init__(self, num_virtual_tokens, token_dim, num_transformer_submodules=2):
        self.peft_type = PROMPT_TUNING
        self.num_virtual_tokens = num_virtual_tokens
        self.token_dim = token_dim
        self.num_transformer_submodules = num_transformer_submodules
        self.is_prompt_learning = True


class PromptEmbedding(nn.Module):
    # peft/tuners/prompt_tuning.py
    def __init__(self, config, word_embeddings):
        super().__init__()
        total_virtual_tokens = config.num_virtual_tokens * config.num_transformer_submodules
        self.embedding = nn.Embedding(total_virtual_tokens, config.token_dim)
        # prompt_tuning_init == RANDOM

    def forward(self, indices):
        return self.embedding(indices)


def _get_batch_size(input_ids, inputs_embeds):
    if (input_ids is None) and (inputs_embeds is None):
        raise ValueError("You have to provide either input_ids or inputs_embeds")
    if input_ids is not None:
        return input_ids.shape[0]
    return inputs_embeds.shape[0]


class PeftModelForSeq2SeqLM(nn.Module):
    def __init__(self, model, peft_config):
        super().__init__()
        self.base_model = model
        self.active_peft_config = peft_config
        self.word_embeddings = model.get_input_embeddings()
        self.prompt_encoder = PromptEmbedding(peft_config, self.word_embeddings)
        self.prompt_tokens = torch.arange(
            peft_config.num_virtual_tokens * peft_config.num_transformer_submodules
        ).long()

    def get_prompt(self, batch_size):
        prompt_tokens = self.prompt_tokens.unsqueeze(0).expand(batch_size, -1)
        return self.prompt_encoder(prompt_tokens)

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        inputs_embeds=None,
        decoder_input_ids=None,
        decoder_attention_mask=None,
        decoder_inputs_embeds=None,
        labels=None,
        output_attentions=None,
        output_hidden_states=None,
        return_dict=None,
        **kwargs,
    ):
        peft_config = self.active_peft_config
        batch_size = _get_batch_size(input_ids, inputs_embeds)
        if decoder_attention_mask is not None:
            # concat prompt attention mask
            prefix_attention_mask = torch.ones(batch_size, peft_config.num_virtual_tokens).to(
                decoder_attention_mask.device
            )
            if FIXED:
                if peft_config.peft_type not in [PROMPT_TUNING, P_TUNING]:
                    decoder_attention_mask = torch.cat((prefix_attention_mask, decoder_attention_mask), dim=1)
            else:
                decoder_attention_mask = torch.cat((prefix_attention_mask, decoder_attention_mask), dim=1)

        if kwargs.get("position_ids", None) is not None:
            warnings.warn("Position ids are not supported for parameter efficient tuning. Ignoring position ids.")
            kwargs["position_ids"] = None
        kwargs.update(
            {
                "attention_mask": attention_mask,
                "decoder_attention_mask": decoder_attention_mask,
                "labels": labels,
                "output_attentions": output_attentions,
                "output_hidden_states": output_hidden_states,
                "return_dict": return_dict,
            }
        )

        # PROMPT_TUNING / P_TUNING branch
        if inputs_embeds is None:
            inputs_embeds = self.word_embeddings(input_ids)

        if attention_mask is not None:
            # concat prompt attention mask
            prefix_attention_mask = torch.ones(batch_size, peft_config.num_virtual_tokens).to(attention_mask.device)
            kwargs["attention_mask"] = torch.cat((prefix_attention_mask, attention_mask), dim=1)

        prompts = self.get_prompt(batch_size=batch_size)
        prompts = prompts.to(inputs_embeds.dtype)
        inputs_embeds = torch.cat((prompts[:, : peft_config.num_virtual_tokens], inputs_embeds), dim=1)

        return self.base_model(
            inputs_embeds=inputs_embeds,
            decoder_input_ids=decoder_input_ids,
            decoder_inputs_embeds=decoder_inputs_embeds,
            **kwargs,
        )


def main():
    torch.manual_seed(0)
    pad = 0
    config = T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
        decoder_start_token_id=pad, pad_token_id=pad, eos_token_id=1, dropout_rate=0.0,
    )
    base = T5ForConditionalGeneration(config).eval()
    peft_config = PromptTuningConfig(num_virtual_tokens=4, token_dim=config.d_model)
    model = PeftModelForSeq2SeqLM(base, peft_config).eval()

    # right-padded source and target batch, as DataCollatorForSeq2Seq produces
    src_lens, tgt_lens = [7, 4, 5], [6, 3, 4]
    S, T = max(src_lens), max(tgt_lens)
    input_ids = torch.full((3, S), pad)
    labels = torch.full((3, T), pad)
    for b, (ls, lt) in enumerate(zip(src_lens, tgt_lens)):
        input_ids[b, :ls] = torch.randint(2, 64, (ls,))
        labels[b, :lt] = torch.randint(2, 64, (lt,))
    attention_mask = (input_ids != pad).long()
    decoder_input_ids = base._shift_right(labels)
    decoder_attention_mask = torch.zeros(3, T, dtype=torch.long)
    for b, lt in enumerate(tgt_lens):
        decoder_attention_mask[b, :lt] = 1
    labels = labels.masked_fill(labels == pad, -100)

    with torch.no_grad():
        out = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            decoder_input_ids=decoder_input_ids,
            decoder_attention_mask=decoder_attention_mask,
            labels=labels,
        )
    print("loss:", round(out.loss.item(), 6))
    print("logits sum per example:", [round(v, 4) for v in out.logits.sum(dim=(1, 2)).tolist()])
    print("logits abs mean:", round(out.logits.abs().mean().item(), 6))


if __name__ == "__main__":
    main()

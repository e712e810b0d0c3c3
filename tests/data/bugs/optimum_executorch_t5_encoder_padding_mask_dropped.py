# huggingface/optimum-executorch#230 (same fix proposed as huggingface/transformers#45523): the T5 ExecuTorch
# export wrappers call the encoder without attention_mask and the decoder without encoder_attention_mask,
# so PAD tokens of the fixed-length encoder input are attended to.
import sys

import torch
from torch import nn
from transformers import T5Config, T5ForConditionalGeneration

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class Seq2SeqLMEncoderExportableModule(nn.Module):
    def __init__(self, encoder_model):
        super().__init__()
        self.encoder = encoder_model

    def forward(self, input_ids):
        if FIXED:
            attention_mask = (input_ids != 0).long()
            hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            return hidden * attention_mask.unsqueeze(-1).to(hidden.dtype)
        return self.encoder(input_ids=input_ids).last_hidden_state


class Seq2SeqLMDecoderExportableModule(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.decoder = model.get_decoder()
        self.lm_head = model.lm_head

    def forward(self, decoder_input_ids, encoder_hidden_states, encoder_attention_mask=None):
        if FIXED:
            out = self.decoder(input_ids=decoder_input_ids, encoder_hidden_states=encoder_hidden_states,
                               encoder_attention_mask=encoder_attention_mask, use_cache=False)
        else:
            out = self.decoder(input_ids=decoder_input_ids, encoder_hidden_states=encoder_hidden_states,
                               use_cache=False)
        return self.lm_head(out.last_hidden_state)


def main():
    config = T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
                      num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=16,
                      dropout_rate=0.0, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    model = T5ForConditionalGeneration(config).eval()
    encoder = Seq2SeqLMEncoderExportableModule(model.get_encoder())
    decoder = Seq2SeqLMDecoderExportableModule(model)

    max_enc_len = 16  # static encoder length of the exported program
    prompt = torch.tensor([[5, 17, 23, 9, 31, 1]])
    input_ids = torch.zeros(1, max_enc_len, dtype=torch.long)
    input_ids[0, : prompt.shape[1]] = prompt[0]

    with torch.no_grad():
        enc = encoder(input_ids)
        dec_ids = torch.tensor([[config.decoder_start_token_id]])
        logits = decoder(dec_ids, enc, (input_ids != 0).long())

        # reference: the unpadded prompt, which needs no mask
        ref_enc = model.get_encoder()(input_ids=prompt).last_hidden_state
        ref = decoder(dec_ids, ref_enc, torch.ones_like(prompt))
    diff = (logits[0, -1] - ref[0, -1]).abs().max().item()
    print(f"fixed={FIXED} max |logits - unpadded reference| = {diff:.6f}")


if __name__ == "__main__":
    main()

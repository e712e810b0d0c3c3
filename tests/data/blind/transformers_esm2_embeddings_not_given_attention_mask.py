# HF transformers ESM-2 (huggingface/transformers#44163, fixes #44162 "ESM2 attention_mask and token_dropout fix"):
# after the attention-API refactor EsmModel.forward called self.embeddings(input_ids, position_ids) without the
# padding attention_mask, so token-dropout rescaling used the padded length and pad embeddings were not zeroed.
import sys

import torch
from transformers import EsmConfig
from transformers.models.esm import modeling_esm
from transformers.modeling_outputs import BaseModelOutputWithPoolingAndCrossAttentions

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class EsmModel(modeling_esm.EsmModel):
    # EsmModel.forward as of transformers d1fd30d (before the fix), trimmed to the encoder-only path
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None, **kwargs):
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")

        if inputs_embeds is None:
            if FIXED:
                # Important, attention_mask must be passed to the embedding class
                # This effects how the token_dropout is calculated
                inputs_embeds = self.embeddings(
                    input_ids=input_ids,
                    attention_mask=attention_mask,
                    position_ids=position_ids,
                )
            else:
                inputs_embeds = self.embeddings(
                    input_ids=input_ids,
                    position_ids=position_ids,
                )

        if self.config._attn_implementation != "flash_attention_2":
            batch_size, seq_length = inputs_embeds.shape[:-1]
            if attention_mask is None:
                attention_mask = torch.ones(((batch_size, seq_length)), device=inputs_embeds.device)
            # self.get_extended_attention_mask(attention_mask, input_shape=(batch_size, seq_length))
            extended = attention_mask[:, None, None, :].to(inputs_embeds.dtype)
            attention_mask = (1.0 - extended) * torch.finfo(inputs_embeds.dtype).min

        # rotary position embeddings (ESM-2), computed once and handed to every layer
        seq_len = inputs_embeds.shape[1]
        rope_position_ids = torch.arange(seq_len, device=inputs_embeds.device).unsqueeze(0)
        position_embeddings = self.rotary_embeddings(inputs_embeds, rope_position_ids)

        encoder_outputs = self.encoder(inputs_embeds, attention_mask=attention_mask,
                                       position_embeddings=position_embeddings)
        sequence_output = encoder_outputs[0]
        return BaseModelOutputWithPoolingAndCrossAttentions(last_hidden_state=sequence_output)


# ESM-2 alphabet: <cls>=0 <pad>=1 <eos>=2 <unk>=3, residues 4..28, <mask>=32
config = EsmConfig(vocab_size=33, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                   max_position_embeddings=64, position_embedding_type="rotary", token_dropout=True,
                   emb_layer_norm_before=False, pad_token_id=1, mask_token_id=32,
                   hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
config._attn_implementation = "eager"
model = EsmModel(config, add_pooling_layer=False).eval()

CLS, PAD, EOS, MASK = 0, 1, 2, 32
long_seq = torch.randint(4, 29, (22,))
short_seq = torch.randint(4, 29, (10,))
long_seq[5] = MASK   # one masked residue per protein (MLM scoring)
short_seq[3] = MASK
long_ids = [CLS] + long_seq.tolist() + [EOS]
short_ids = [CLS] + short_seq.tolist() + [EOS]
L = len(long_ids)
input_ids = torch.tensor([long_ids, short_ids + [PAD] * (L - len(short_ids))])
attention_mask = (input_ids != PAD).long()

with torch.no_grad():
    batched = model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    alone = model(input_ids=torch.tensor([short_ids]),
                  attention_mask=torch.ones(1, len(short_ids), dtype=torch.long)).last_hidden_state

n = len(short_ids)
diff = (batched[1, :n] - alone[0]).abs().max().item()
print(f"fixed={FIXED} max |hidden(short protein, padded batch) - hidden(alone)| = {diff:.6f}")

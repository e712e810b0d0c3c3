"""Three correct ways positions reach a learned position table that keeps a padding row, each quiet:

1. LXMERT's embeddings (an nn.Embedding(padding_idx=0) position table) number the tokens from 0 themselves: the
   model is handed no positions, its own numbering is what it trained on.
2. transformers' RobertaForCausalLM under `generate`: generate hands it position_ids counted from 0 (the library's
   choice, not the program's).
3. An XLM-R encoder handed position_ids the program computed from a left-padded batch as the model does: real tokens
   from padding_idx + 1, the pads at padding_idx.
"""

import torch
from transformers import LxmertConfig, LxmertModel, RobertaConfig, RobertaForCausalLM, XLMRobertaConfig, \
    XLMRobertaModel

torch.manual_seed(0)
small = dict(hidden_size=16, num_attention_heads=2, intermediate_size=32, max_position_embeddings=64)

lxmert = LxmertModel(LxmertConfig(vocab_size=50, l_layers=1, x_layers=1, r_layers=1, visual_feat_dim=8,
                                  visual_pos_dim=4, **small)).eval()
with torch.no_grad():
    out = lxmert(input_ids=torch.tensor([[3, 4, 5, 6], [7, 8, 0, 0]]),
                 attention_mask=torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]]),
                 visual_feats=torch.randn(2, 3, 8), visual_pos=torch.rand(2, 3, 4))
print("lxmert", out.language_output.shape)

decoder = RobertaForCausalLM(RobertaConfig(vocab_size=50, num_hidden_layers=1, is_decoder=True, **small)).eval()
generated = decoder.generate(torch.tensor([[5, 6, 7, 8]]), attention_mask=torch.ones(1, 4, dtype=torch.long),
                             max_new_tokens=3, do_sample=False)
print("generated", generated.tolist())

encoder = XLMRobertaModel(XLMRobertaConfig(vocab_size=50, num_hidden_layers=1, **small)).eval()
pad = encoder.config.pad_token_id
ids = torch.tensor([[pad, pad, 5, 6, 7], [8, 9, 10, 11, 12]])
mask = ids.ne(pad).long()
position_ids = torch.cumsum(mask, dim=1) * mask + pad
with torch.no_grad():
    handed = encoder(input_ids=ids, attention_mask=mask, position_ids=position_ids).last_hidden_state
    own = encoder(input_ids=ids, attention_mask=mask).last_hidden_state
print("handed positions as the model numbers them:", (handed - own)[mask.bool()].abs().max().item() < 1e-5)

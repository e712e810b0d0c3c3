"""MiniGPT-v2: image tokens spliced into the instruction, right-padded training, left-padded generation.

Port of Vision-CAIR/MiniGPT-4 @748d18b5df1e0eafaa3ea085c0d88103961e7170:
  minigpt4/models/minigpt_base.py   MiniGPTBase.prompt_wrap (each prompt split at '<ImageHere>', the
                                    image's tokens spliced between the segments, rows right-padded
                                    with the pad embedding and wrapped_atts 1 on the real part),
                                    concat_emb_input_output (the answer put right after each row's
                                    real input, the input's padding moved behind it), forward (BOS in
                                    front, targets -100 except the answer), get_context_emb and
                                    generate (rows left-padded into `embs` / `attn_mask`,
                                    llama_model.generate(inputs_embeds=..., attention_mask=...))
  minigpt4/models/minigpt_v2.py     MiniGPTv2.encode_img (ViT tokens minus CLS, 4 neighbours
                                    concatenated, llama_proj; atts_llama all ones)
The EVA ViT is replaced by a one-layer patch embedding + LayerNorm with a CLS token (the vision side
has no mask), the LLaMA by transformers' LlamaForCausalLM from a tiny LlamaConfig, the LLaMA tokenizer
by an in-memory word-level tokenizer with the same special ids (unk 0, <s> 1, </s> 2; pad = unk as the
project sets it). Two samples with different prompts (the image in a different place) and answers.
Checked against each sample run alone, unpadded and without an attention_mask: the training loss
(summed answer-token losses / answer tokens) and the logits at every real position, and greedy
generation (tokens and per-step scores).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

torch.manual_seed(0)

WORDS = ("[INST] [/INST] <Img> </Img> describe the image what is in this picture a cat on mat "
         "dog red ball sits plays with grass green").split(" ")


def make_tokenizer():
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for w in WORDS:
        if w not in vocab:
            vocab[w] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    t = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    t.pad_token = t.unk_token  # the project: llama_tokenizer.pad_token = "$$" / unk
    return t


class TinyViT(nn.Module):
    """Stand-in for EVA-CLIP: CLS + 16 patch tokens, `num_features` wide."""

    def __init__(self, num_features=16, patch=4, img_size=16):
        super().__init__()
        self.num_features = num_features
        self.patch_embed = nn.Conv2d(3, num_features, patch, patch)
        self.cls_token = nn.Parameter(torch.randn(1, 1, num_features) * 0.02)

    def forward(self, x):
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        return torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)


class MiniGPTv2(nn.Module):
    def __init__(self, llama_model, llama_tokenizer, max_txt_len=300, max_context_len=3800, end_sym="</s>",
                 prompt_template="[INST] {} [/INST]"):
        super().__init__()
        self.llama_model, self.llama_tokenizer = llama_model, llama_tokenizer
        self.visual_encoder = TinyViT()
        self.ln_vision = nn.LayerNorm(self.visual_encoder.num_features)
        self.max_txt_len = max_txt_len
        self.max_context_len = max_context_len
        self.end_sym = end_sym
        self.prompt_template = prompt_template
        self.chat_template = True
        img_f_dim = self.visual_encoder.num_features * 4
        self.llama_proj = nn.Linear(img_f_dim, self.llama_model.config.hidden_size)

    @property
    def device(self):
        return self.llama_proj.weight.device

    def embed_tokens(self, token_ids):
        return self.llama_model.base_model.embed_tokens(token_ids)

    def encode_img(self, image):
        device = image.device
        if len(image.shape) > 4:
            image = image.reshape(-1, *image.shape[-3:])
        image_embeds = self.ln_vision(self.visual_encoder(image)).to(device)
        image_embeds = image_embeds[:, 1:, :]
        bs, pn, hs = image_embeds.shape
        image_embeds = image_embeds.view(bs, int(pn / 4), int(hs * 4))
        inputs_llama = self.llama_proj(image_embeds)
        atts_llama = torch.ones(inputs_llama.size()[:-1], dtype=torch.long).to(image.device)
        return inputs_llama, atts_llama

    def get_context_emb(self, prompt, img_list):
        device = img_list[0].device
        prompt_segs = prompt.split('<ImageHere>')
        assert len(prompt_segs) == len(img_list) + 1, "Unmatched numbers of image placeholders and images."
        seg_tokens = [
            self.llama_tokenizer(seg, return_tensors="pt", add_special_tokens=i == 0).to(device).input_ids
            for i, seg in enumerate(prompt_segs)
        ]
        seg_embs = [self.embed_tokens(seg_t) for seg_t in seg_tokens]
        mixed_embs = [emb for pair in zip(seg_embs[:-1], img_list) for emb in pair] + [seg_embs[-1]]
        mixed_embs = torch.cat(mixed_embs, dim=1)
        return mixed_embs

    def prompt_wrap(self, img_embeds, atts_img, prompts, lengths=None):
        emb_lists = []
        if isinstance(prompts, str):
            prompts = [prompts] * len(img_embeds)
        for idx, (each_img_embed, each_prompt) in enumerate(zip(img_embeds, prompts)):
            pn = each_img_embed.shape[-2]
            p_segs = each_prompt.split('<ImageHere>')
            interleave_emb = []
            for idx, seg in enumerate(p_segs[:-1]):
                p_tokens = self.llama_tokenizer(seg, return_tensors="pt", add_special_tokens=False).to(img_embeds.device)
                p_embed = self.embed_tokens(p_tokens.input_ids)
                interleave_emb.append(torch.cat([p_embed, each_img_embed[None][:, idx * pn:(idx + 1) * pn]], dim=1))
            wrapped_emb = torch.cat(interleave_emb, dim=1)
            p_tokens = self.llama_tokenizer(p_segs[-1], return_tensors="pt", add_special_tokens=False).to(img_embeds.device)
            p_embed = self.embed_tokens(p_tokens.input_ids)
            wrapped_emb = torch.cat([wrapped_emb, p_embed], dim=1)
            emb_lists.append(wrapped_emb)

        emb_lens = [emb.shape[1] for emb in emb_lists]
        pad_emb = self.embed_tokens(torch.tensor(self.llama_tokenizer.pad_token_id, device=img_embeds.device))
        max_length = max(emb_lens) if max(emb_lens) < self.max_context_len else self.max_context_len
        wrapped_embs = pad_emb.expand(len(emb_lens), max_length, -1).clone()
        wrapped_atts = torch.zeros([len(emb_lens), max_length], dtype=torch.int, device=img_embeds.device)
        for i, emb in enumerate(emb_lists):
            length = emb_lens[i] if emb_lens[i] < self.max_context_len else self.max_context_len
            wrapped_embs[i, :length] = emb[:, :length]
            wrapped_atts[i, :length] = 1
        return wrapped_embs, wrapped_atts

    def concat_emb_input_output(self, input_embs, input_atts, output_embs, output_atts):
        input_lens = []
        cat_embs = []
        cat_atts = []
        for i in range(input_embs.size(0)):
            input_len = input_atts[i].sum()
            input_lens.append(input_len)
            cat_embs.append(torch.cat([input_embs[i][:input_len], output_embs[i], input_embs[i][input_len:]]))
            cat_atts.append(torch.cat([input_atts[i][:input_len], output_atts[i], input_atts[i][input_len:]]))
        cat_embs = torch.stack(cat_embs)
        cat_atts = torch.stack(cat_atts)
        return cat_embs, cat_atts, input_lens

    def preparing_embedding(self, samples):
        img_embeds, img_atts = self.encode_img(samples["image"])
        instruction = samples["instruction_input"]
        if self.chat_template:
            instruction = [self.prompt_template.format(instruct) for instruct in instruction]
        cond_embeds, cond_atts = self.prompt_wrap(img_embeds, img_atts, instruction)

        self.llama_tokenizer.padding_side = "right"
        text = [t + self.end_sym for t in samples["answer"]]
        regress_tokens = self.llama_tokenizer(text, return_tensors="pt", padding="longest", truncation=True,
                                              max_length=self.max_txt_len, add_special_tokens=False).to(self.device)
        regress_token_ids = regress_tokens.input_ids
        regress_atts = regress_tokens.attention_mask
        part_targets = regress_token_ids.masked_fill(regress_token_ids == self.llama_tokenizer.pad_token_id, -100)
        regress_embeds = self.embed_tokens(regress_token_ids)
        return cond_embeds, cond_atts, regress_embeds, regress_atts, part_targets

    def forward(self, samples):
        cond_embeds, cond_atts, regress_embeds, regress_atts, part_targets = self.preparing_embedding(samples)
        inputs_embeds, attention_mask, input_lens = \
            self.concat_emb_input_output(cond_embeds, cond_atts, regress_embeds, regress_atts)

        bos = torch.ones_like(part_targets[:, :1]) * self.llama_tokenizer.bos_token_id
        bos_embeds = self.embed_tokens(bos)
        bos_atts = cond_atts[:, :1]
        inputs_embeds = torch.cat([bos_embeds, inputs_embeds], dim=1)
        attention_mask = torch.cat([bos_atts, attention_mask], dim=1)

        targets = torch.ones([inputs_embeds.shape[0], inputs_embeds.shape[1]],
                             dtype=torch.long).to(self.device).fill_(-100)
        for i, target in enumerate(part_targets):
            targets[i, input_lens[i] + 1:input_lens[i] + len(target) + 1] = target  # plus 1 for bos

        outputs = self.llama_model(inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                                   return_dict=True, labels=targets)
        return {"loss": outputs.loss, "logits": outputs.logits, "attention_mask": attention_mask,
                "targets": targets}

    @torch.no_grad()
    def generate(self, images, texts, max_new_tokens=6):
        img_embeds, atts_img = self.encode_img(images.to(self.device))
        image_lists = [[image_emb[None]] for image_emb in img_embeds]
        batch_embs = [self.get_context_emb(text, img_list) for text, img_list in zip(texts, image_lists)]

        batch_size = len(batch_embs)
        max_len = max([emb.shape[1] for emb in batch_embs])
        emb_dim = batch_embs[0].shape[2]
        dtype = batch_embs[0].dtype
        device = batch_embs[0].device
        embs = torch.zeros([batch_size, max_len, emb_dim], dtype=dtype, device=device)
        attn_mask = torch.zeros([batch_size, max_len], dtype=torch.int, device=device)
        for i, emb in enumerate(batch_embs):
            emb_len = emb.shape[1]
            embs[i, -emb_len:] = emb[0]
            attn_mask[i, -emb_len:] = 1

        outputs = self.llama_model.generate(inputs_embeds=embs, attention_mask=attn_mask,
                                            max_new_tokens=max_new_tokens, num_beams=1, do_sample=False,
                                            min_length=1, output_scores=True, return_dict_in_generate=True,
                                            pad_token_id=self.llama_tokenizer.pad_token_id, eos_token_id=None)
        return outputs, batch_embs


def main():
    tok = make_tokenizer()
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2, initializer_range=0.1)
    cfg._attn_implementation = "sdpa"
    llm = LlamaForCausalLM(cfg).eval()
    model = MiniGPTv2(llm, tok).eval()

    images = torch.randn(2, 3, 16, 16)
    samples = {
        "image": images,
        "instruction_input": ["<Img><ImageHere></Img> describe the image",
                              "what is in this picture <Img><ImageHere></Img>"],
        "answer": ["a cat sits on a red mat", "dog"],
    }

    torch.set_grad_enabled(False)
    for impl in ("sdpa", "eager"):
        llm.config._attn_implementation = impl
        for layer in llm.model.layers:
            layer.self_attn.config._attn_implementation = impl
        out = model(samples)
        logits, am, targets = out["logits"], out["attention_mask"], out["targets"]

        # reference: each sample alone, built the same way, without padding or a mask
        tot_loss, tot_n = 0.0, 0
        for i in range(2):
            one = {"image": images[i:i + 1], "instruction_input": samples["instruction_input"][i:i + 1],
                   "answer": samples["answer"][i:i + 1]}
            cond, cond_atts, reg, reg_atts, part_t = model.preparing_embedding(one)
            assert cond_atts.all() and reg_atts.all()
            bos = model.embed_tokens(torch.tensor([[tok.bos_token_id]]))
            emb = torch.cat([bos, cond, reg], dim=1)
            ref_logits = llm(inputs_embeds=emb).logits[0]
            n = emb.shape[1]
            real = am[i].bool()
            assert int(real.sum()) == n and bool(real[:n].all())
            torch.testing.assert_close(logits[i, :n], ref_logits, atol=1e-5, rtol=1e-5)
            lab = torch.cat([torch.full((1 + cond.shape[1],), -100), part_t[0]])
            tot_loss += F.cross_entropy(ref_logits[:-1], lab[1:], ignore_index=-100, reduction="sum")
            tot_n += int((lab[1:] != -100).sum())
            torch.testing.assert_close(targets[i, :n], lab)
        torch.testing.assert_close(out["loss"], tot_loss / tot_n, atol=1e-5, rtol=1e-5)

        # generation: left-padded batch against each sample alone
        texts = ["[INST] <Img><ImageHere></Img> describe the image [/INST]",
                 "[INST] what is in this picture with a green ball <Img><ImageHere></Img> [/INST]"]
        gen, batch_embs = model.generate(images, texts)
        for i in range(2):
            alone = llm.generate(inputs_embeds=batch_embs[i], max_new_tokens=6, do_sample=False,
                                 output_scores=True, return_dict_in_generate=True,
                                 pad_token_id=tok.pad_token_id, eos_token_id=None)
            assert torch.equal(gen.sequences[i], alone.sequences[0]), (impl, i, gen.sequences, alone.sequences)
            for s_b, s_a in zip(gen.scores, alone.scores):
                torch.testing.assert_close(s_b[i], s_a[0], atol=1e-4, rtol=1e-4)
        print(impl, "loss", float(out["loss"]), "generated", gen.sequences.tolist())
    print("ok")


if __name__ == "__main__":
    main()

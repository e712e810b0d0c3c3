# mosaicml/diffusion#149 (commit 93a5469, "Only make a text encoder mask if mask_pad_tokens is true"):
# StableDiffusion.forward (training) handed the batch's tokenizer attention_mask to the CLIP text encoder whenever the
# batch carried one, even with mask_pad_tokens=False, while the U-Net's cross-attention (and generate(), after #147)
# left the pad tokens unmasked: the pad-token text embeddings the U-Net cross-attends to differ from the ones it sees
# at inference. The fix reads the batch's attention_mask (for the text encoder and the U-Net) only when
# mask_pad_tokens is set. Ported from diffusion/models/stable_diffusion.py @93a5469^ (forward,
# _create_unet_attention_mask); the U-Net is a one-block stand-in written like diffusers' UNet2DConditionModel
# (encoder_attention_mask -> (1 - mask) * -10000.0, unsqueeze(1)) and Attention / AttnProcessor2_0.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import CLIPTextConfig, CLIPTextModel

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

PAD, BOS, EOS = 0, 1, 2  # SD2's tokenizer pads with "!" (id 0), not with the end token
MAX_LEN = 16


class Attention(nn.Module):
    """diffusers Attention with AttnProcessor2_0, trimmed."""

    def __init__(self, query_dim, cross_attention_dim=None, heads=4, dim_head=8):
        super().__init__()
        inner_dim = heads * dim_head
        cross_attention_dim = cross_attention_dim if cross_attention_dim is not None else query_dim
        self.heads = heads
        self.to_q = nn.Linear(query_dim, inner_dim, bias=False)
        self.to_k = nn.Linear(cross_attention_dim, inner_dim, bias=False)
        self.to_v = nn.Linear(cross_attention_dim, inner_dim, bias=False)
        self.to_out = nn.ModuleList([nn.Linear(inner_dim, query_dim), nn.Dropout(0.0)])

    def prepare_attention_mask(self, attention_mask, target_length, batch_size, out_dim=3):
        head_size = self.heads
        if attention_mask is None:
            return attention_mask
        current_length = attention_mask.shape[-1]
        if current_length != target_length:
            attention_mask = F.pad(attention_mask, (0, target_length), value=0.0)
        if out_dim == 3:
            if attention_mask.shape[0] < batch_size * head_size:
                attention_mask = attention_mask.repeat_interleave(head_size, dim=0)
        elif out_dim == 4:
            attention_mask = attention_mask.unsqueeze(1)
            attention_mask = attention_mask.repeat_interleave(head_size, dim=1)
        return attention_mask

    def forward(self, hidden_states, encoder_hidden_states=None, attention_mask=None):
        batch_size, sequence_length, _ = (
            hidden_states.shape if encoder_hidden_states is None else encoder_hidden_states.shape
        )
        if attention_mask is not None:
            attention_mask = self.prepare_attention_mask(attention_mask, sequence_length, batch_size)
            # scaled_dot_product_attention expects attention_mask shape to be
            # (batch, heads, source_length, target_length)
            attention_mask = attention_mask.view(batch_size, self.heads, -1, attention_mask.shape[-1])

        query = self.to_q(hidden_states)
        if encoder_hidden_states is None:
            encoder_hidden_states = hidden_states
        key = self.to_k(encoder_hidden_states)
        value = self.to_v(encoder_hidden_states)

        inner_dim = key.shape[-1]
        head_dim = inner_dim // self.heads
        query = query.view(batch_size, -1, self.heads, head_dim).transpose(1, 2)
        key = key.view(batch_size, -1, self.heads, head_dim).transpose(1, 2)
        value = value.view(batch_size, -1, self.heads, head_dim).transpose(1, 2)

        hidden_states = F.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, dropout_p=0.0, is_causal=False
        )
        hidden_states = hidden_states.transpose(1, 2).reshape(batch_size, -1, self.heads * head_dim)
        hidden_states = self.to_out[0](hidden_states)
        hidden_states = self.to_out[1](hidden_states)
        return hidden_states


class BasicTransformerBlock(nn.Module):
    def __init__(self, dim, cross_attention_dim):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn1 = Attention(dim)
        self.norm2 = nn.LayerNorm(dim)
        self.attn2 = Attention(dim, cross_attention_dim=cross_attention_dim)
        self.norm3 = nn.LayerNorm(dim)
        self.ff = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, hidden_states, encoder_hidden_states=None, encoder_attention_mask=None):
        hidden_states = self.attn1(self.norm1(hidden_states)) + hidden_states
        hidden_states = (
            self.attn2(self.norm2(hidden_states), encoder_hidden_states, attention_mask=encoder_attention_mask)
            + hidden_states
        )
        hidden_states = self.ff(self.norm3(hidden_states)) + hidden_states
        return hidden_states


class UNet2DConditionModel(nn.Module):
    """A one-block stand-in for diffusers' UNet2DConditionModel (conv_in, timestep embedding, one spatial
    transformer, conv_out), with its handling of encoder_attention_mask."""

    def __init__(self, in_channels=4, block_out_channels=32, cross_attention_dim=32):
        super().__init__()
        self.conv_in = nn.Conv2d(in_channels, block_out_channels, 3, padding=1)
        self.time_embedding = nn.Sequential(nn.Linear(1, block_out_channels), nn.SiLU())
        self.transformer = BasicTransformerBlock(block_out_channels, cross_attention_dim)
        self.conv_out = nn.Conv2d(block_out_channels, in_channels, 3, padding=1)

    def forward(self, sample, timestep, encoder_hidden_states, encoder_attention_mask=None, added_cond_kwargs=None):
        # convert encoder_attention_mask to a bias the same way we do for attention_mask
        if encoder_attention_mask is not None:
            encoder_attention_mask = (1 - encoder_attention_mask.to(sample.dtype)) * -10000.0
            encoder_attention_mask = encoder_attention_mask.unsqueeze(1)

        emb = self.time_embedding(timestep.float().view(-1, 1) / 1000.0)
        h = self.conv_in(sample) + emb[:, :, None, None]
        b, c, hh, ww = h.shape
        h = h.permute(0, 2, 3, 1).reshape(b, hh * ww, c)
        h = self.transformer(h, encoder_hidden_states=encoder_hidden_states,
                             encoder_attention_mask=encoder_attention_mask)
        h = h.reshape(b, hh, ww, c).permute(0, 3, 1, 2)
        return {'sample': self.conv_out(h)}


class _LatentDist:
    def __init__(self, mean):
        self.mean = mean

    def sample(self):
        return self.mean


class TinyVAE(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Conv2d(3, 4, 8, stride=8)

    def encode(self, x):
        return {'latent_dist': _LatentDist(self.enc(x))}


class DDPMScheduler:
    def __init__(self, num_train_timesteps=1000):
        betas = torch.linspace(0.00085 ** 0.5, 0.012 ** 0.5, num_train_timesteps) ** 2
        self.alphas_cumprod = torch.cumprod(1.0 - betas, dim=0)
        self.num_train_timesteps = num_train_timesteps

    def add_noise(self, original_samples, noise, timesteps):
        a = self.alphas_cumprod[timesteps].view(-1, 1, 1, 1)
        return a.sqrt() * original_samples + (1 - a).sqrt() * noise


def _create_unet_attention_mask(attention_mask):
    """Takes the union of multiple attention masks if given more than one mask."""
    if len(attention_mask.shape) == 2:
        return attention_mask
    elif len(attention_mask.shape) == 3:
        encoder_attention_mask = attention_mask[:, 0]
        for i in range(1, attention_mask.shape[1]):
            encoder_attention_mask |= attention_mask[:, i]
        return encoder_attention_mask
    else:
        raise ValueError(f'attention_mask should have either 2 or 3 dimensions: {attention_mask.shape}')


class StableDiffusion(nn.Module):
    def __init__(self, unet, vae, text_encoder, noise_scheduler, mask_pad_tokens=False,
                 image_key='image', text_key='captions', latent_mean=0.0, latent_std=1 / 0.18215):
        super().__init__()
        self.unet = unet
        self.vae = vae
        self.text_encoder = text_encoder
        self.noise_scheduler = noise_scheduler
        self.mask_pad_tokens = mask_pad_tokens
        self.image_key = image_key
        self.text_key = text_key
        self.latent_mean = latent_mean
        self.latent_std = latent_std
        self.prediction_type = 'epsilon'
        self.sdxl = False
        self.precomputed_latents = False
        self.loss_fn = F.mse_loss
        self.rng_generator = torch.Generator().manual_seed(1234)

    def _generate_timesteps(self, latents):
        return torch.randint(0, self.noise_scheduler.num_train_timesteps, (latents.shape[0],),
                             device=latents.device, generator=self.rng_generator)

    def forward(self, batch):
        latents, text_embeds, text_pooled_embeds, attention_mask, encoder_attention_mask = None, None, None, None, None
        if FIXED:
            if 'attention_mask' in batch and self.mask_pad_tokens:
                attention_mask = batch['attention_mask']  # mask for text encoders
                encoder_attention_mask = _create_unet_attention_mask(attention_mask)  # text mask for U-Net
        else:
            if 'attention_mask' in batch:
                attention_mask = batch['attention_mask']  # mask for text encoders
                # text mask for U-Net
                if self.mask_pad_tokens:
                    encoder_attention_mask = _create_unet_attention_mask(attention_mask)

        inputs, conditionings = batch[self.image_key], batch[self.text_key]
        latents = self.vae.encode(inputs)['latent_dist'].sample().data
        # Encode tokenized prompt into embedded text and pooled text embeddings
        text_encoder_out = self.text_encoder(conditionings, attention_mask=attention_mask)
        text_embeds = text_encoder_out[0]

        # Scale the latents
        latents = (latents - self.latent_mean) / self.latent_std

        # Zero dropped captions if needed
        if 'drop_caption_mask' in batch.keys():
            text_embeds *= batch['drop_caption_mask'].view(-1, 1, 1)

        # Sample the diffusion timesteps
        timesteps = self._generate_timesteps(latents)
        # Add noise to the inputs (forward diffusion)
        noise = torch.randn(*latents.shape, device=latents.device, generator=self.rng_generator)
        noised_latents = self.noise_scheduler.add_noise(latents, noise, timesteps)
        targets = noise

        added_cond_kwargs = {}
        # Forward through the model
        return self.unet(noised_latents,
                         timesteps,
                         text_embeds,
                         encoder_attention_mask=encoder_attention_mask,
                         added_cond_kwargs=added_cond_kwargs)['sample'], targets, timesteps

    def loss(self, outputs, batch):
        """Loss between unet output and added noise, typically mse."""
        return self.loss_fn(outputs[0], outputs[1])


def tokenize(token_lists):
    """What the dataset's CLIP tokenizer returns with padding='max_length'."""
    input_ids = torch.full((len(token_lists), MAX_LEN), PAD, dtype=torch.long)
    attention_mask = torch.zeros((len(token_lists), MAX_LEN), dtype=torch.long)
    for i, toks in enumerate(token_lists):
        ids = [BOS] + toks + [EOS]
        input_ids[i, :len(ids)] = torch.tensor(ids)
        attention_mask[i, :len(ids)] = 1
    return input_ids, attention_mask


def main():
    text_config = CLIPTextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, max_position_embeddings=MAX_LEN, pad_token_id=PAD,
                                 bos_token_id=BOS, eos_token_id=EOS, projection_dim=32)
    text_encoder = CLIPTextModel(text_config).eval()
    text_encoder.requires_grad_(False)
    model = StableDiffusion(UNet2DConditionModel(), TinyVAE(), text_encoder, DDPMScheduler(),
                            mask_pad_tokens=False)
    model.train()

    captions, attention_mask = tokenize([[5, 9, 13, 21, 34, 8], [7, 11, 3]])
    batch = {
        'image': torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(7)),
        'captions': captions,
        'attention_mask': attention_mask,
    }
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    for step in range(3):
        outputs = model(batch)
        loss = model.loss(outputs, batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        print(f"step {step} loss {loss.item():.6f}")


if __name__ == "__main__":
    main()

//! The sampling flags of `run` (and of any command that generates), named as llama.cpp's `llama-cli` names them.

use anyhow::Result;
use backburner_engine::SamplingParams;
use clap::Args;

/// Sampling settings ([`SamplingParams`]; the order in which they apply: `backburner_engine::picker`).
#[derive(Args, Clone, Debug)]
pub struct SamplingArgs {
    /// Temperature (0 = greedy).
    #[arg(long, default_value_t = 0.0)]
    pub temp: f32,
    /// Top-k (0 = off).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Top-p (1 = off).
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Min-p (0 = off).
    #[arg(long, default_value_t = 0.0)]
    pub min_p: f32,
    /// RNG seed for sampling (default, or -1 as in llama.cpp: random; the seed used is printed in the stats line
    /// and --json).
    #[arg(short = 's', long, value_parser = parse_seed, allow_negative_numbers = true)]
    pub seed: Option<u64>,
    /// Subtracted from the logit of every token generated so far (OpenAI's presence_penalty, -2..2; 0 = off).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub presence_penalty: f32,
    /// Times a token was generated, times this, is subtracted from its logit (OpenAI's frequency_penalty, -2..2).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub frequency_penalty: f32,
    /// Logits of tokens in the prompt or the output are divided by this when positive, multiplied when not
    /// (transformers' and vLLM's repetition_penalty, over the whole context; llama.cpp's applies to the last 64
    /// tokens; 1 = off).
    #[arg(long, visible_alias = "repetition-penalty", default_value_t = 1.0)]
    pub repeat_penalty: f32,
    /// Add BIAS to the logit of token ID, written as llama.cpp writes it: `ID+BIAS` or `ID-BIAS` (e.g. `15043+1`,
    /// `151645-100`; repeatable; -100..100).
    #[arg(long, value_parser = parse_bias, allow_hyphen_values = true)]
    pub logit_bias: Vec<(u32, f32)>,
}

/// `ID+BIAS` or `ID-BIAS` (llama.cpp's `--logit-bias`).
fn parse_bias(s: &str) -> std::result::Result<(u32, f32), String> {
    let bad = || format!("{s:?}: expected TOKEN_ID+BIAS or TOKEN_ID-BIAS, e.g. 15043+1");
    let at = s.find(['+', '-']).filter(|&i| i > 0).ok_or_else(bad)?;
    let id = s[..at].trim().parse::<u32>().map_err(|_| bad())?;
    let bias = s[at..].trim().parse::<f32>().map_err(|_| bad())?;
    Ok((id, bias))
}

impl SamplingArgs {
    /// The engine's settings, seeded with `seed`.
    pub fn params(&self, seed: u64) -> SamplingParams {
        SamplingParams {
            temperature: self.temp,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            seed,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            repetition_penalty: self.repeat_penalty,
            logit_bias: self.logit_bias.clone(),
        }
    }

    /// Rejects settings that have no meaning (the engine's [`SamplingParams::validate`]), naming the flag.
    pub fn check(&self) -> Result<()> {
        self.params(0).validate().map_err(|e| {
            let m = e.to_string();
            let m = m.strip_prefix("invalid input: ").unwrap_or(&m);
            // the engine names the request fields; here they are flags
            let m = [
                ("temperature", "--temp"),
                ("top_p", "--top-p"),
                ("min_p", "--min-p"),
                ("presence_penalty", "--presence-penalty"),
                ("frequency_penalty", "--frequency-penalty"),
                ("repetition_penalty", "--repeat-penalty"),
                ("logit_bias", "--logit-bias"),
            ]
            .iter()
            .fold(m.to_string(), |m, (field, flag)| m.replacen(field, flag, 1));
            anyhow::anyhow!("{m}")
        })
    }
}

/// `--seed`: a u64, or -1 (llama.cpp's "random"), which draws one here.
fn parse_seed(v: &str) -> Result<u64, String> {
    match v.trim() {
        "-1" => Ok(rand::random()),
        t => t.parse().map_err(|_| {
            format!("{v:?} is not a seed: an integer in 0..=2^64-1, or -1 for a random one")
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::parse_bias;

    #[test]
    fn biases_read_as_llama_cpp_writes_them() {
        assert_eq!(parse_bias("15043+1"), Ok((15043, 1.0)));
        assert_eq!(parse_bias("7-100"), Ok((7, -100.0)));
        assert_eq!(parse_bias("7+2.5"), Ok((7, 2.5)));
        for bad in ["+1", "-1", "x+1", "7", "7+", "7+x"] {
            assert!(parse_bias(bad).is_err(), "{bad}");
        }
    }
}

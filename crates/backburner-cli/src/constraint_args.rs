//! The grammar flags of `run`, named as llama.cpp's `llama-cli` names them.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use backburner_engine::constraint::{ConstraintSpec, Grammar, Grammars};
use backburner_model::TextTokenizer;
use clap::Args;

/// A grammar the output must follow (`backburner_engine::constraint`).
#[derive(Args, Clone, Debug, Default)]
pub struct ConstraintArgs {
    /// Constrain the output to this grammar: GBNF as llama.cpp writes it (`root ::= "yes" | "no"`), or Lark in
    /// llguidance's dialect (`start: …`).
    #[arg(long, group = "grammar_src")]
    pub grammar: Option<String>,
    /// --grammar read from a file.
    #[arg(long, group = "grammar_src")]
    pub grammar_file: Option<PathBuf>,
    /// Constrain the output to a value of this JSON schema (`{}`: any JSON value).
    #[arg(short = 'j', long, group = "grammar_src")]
    pub json_schema: Option<String>,
    /// --json-schema read from a file.
    #[arg(long, group = "grammar_src")]
    pub json_schema_file: Option<PathBuf>,
}

impl ConstraintArgs {
    /// The grammar asked for, read and parsed (files, JSON, GBNF), before the model loads. Errors: a file that
    /// cannot be read, a schema that is not JSON, GBNF that cannot be read, naming the flag.
    pub fn grammar(&self) -> Result<Option<Grammar>> {
        let read = |p: &PathBuf, flag: &str| {
            std::fs::read_to_string(p).with_context(|| format!("{flag}: reading {}", p.display()))
        };
        let text = match (&self.grammar, &self.grammar_file) {
            (Some(g), _) => Some(g.clone()),
            (_, Some(f)) => Some(read(f, "--grammar-file")?),
            _ => None,
        };
        if let Some(t) = text {
            let lark = backburner_engine::gbnf::to_lark(&t)
                .map_err(|m| anyhow::anyhow!("--grammar: {m}"))?;
            return Ok(Some(Grammar::Lark(lark)));
        }
        let schema = match (&self.json_schema, &self.json_schema_file) {
            (Some(s), _) => s.clone(),
            (_, Some(f)) => read(f, "--json-schema-file")?,
            _ => return Ok(None),
        };
        let v: serde_json::Value =
            serde_json::from_str(&schema).context("--json-schema: not JSON")?;
        if !v.is_object() {
            bail!("--json-schema: a schema is a JSON object");
        }
        Ok(Some(Grammar::JsonSchema(v)))
    }

    /// The constraint of `grammar` over `tok`'s vocabulary (a model of `vocab` logits, ending at `eos`), applying
    /// after `after` when given. Errors: the grammar engine's, naming the flag.
    pub fn spec(
        grammar: Grammar,
        tok: &TextTokenizer,
        eos: &[u32],
        after: Option<String>,
    ) -> Result<ConstraintSpec> {
        let grammars = Arc::new(Grammars::new(tok, tok.vocab_size(), eos)?);
        let spec = ConstraintSpec {
            grammars,
            grammar,
            after,
        };
        spec.check()
            .map_err(|e| anyhow::anyhow!("--grammar/--json-schema: {e}"))?;
        Ok(spec)
    }
}

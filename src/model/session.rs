//! A conversation's state on either tier: the tokens its KV cache holds, so that the next turn
//! recomputes only what changed. Harmony's re-render of a conversation drops the analysis of
//! finished turns, so a new turn's ids are not simply the old ones plus more: the session keeps
//! their longest common prefix and computes the rest. Every emitted token is fed back, so the
//! position always equals the cache's length.

use super::Model;
use super::generate::{FallbackSession, Runtime, Session, SessionTier};
use super::sampler::Sampler;
use crate::error::{Error, Result};

/// Why a turn's generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum Finish {
    /// A stop token (its id) was emitted.
    Stop(u32),
    /// `max_new` tokens were emitted.
    MaxTokens,
    /// The cache is full: no position is left for another token.
    ContextFull,
    /// The caller asked to stop (e.g. a client went away).
    Cancelled,
}

pub struct ChatSession<'m> {
    model: &'m Model,
    /// The tier that runs it, its caches keeping every position (a turn may cut them back).
    session: FallbackSession<'m>,
    context: usize,
    /// What the cache holds, position by position.
    tokens: Vec<u32>,
    /// The logits after the last token (None when the cache is empty).
    logits: Option<Vec<f32>>,
}

impl<'m> ChatSession<'m> {
    /// An empty session of at most `context` positions on the CPU tier.
    pub fn new(model: &'m Model, context: usize) -> ChatSession<'m> {
        ChatSession::on(model, FallbackSession::cpu(model, context, true), context)
    }

    /// An empty session of at most `context` positions on the tier `tier` picks, in a runtime
    /// of its own (`Runtime::open`).
    pub fn open(model: &'m Model, tier: &SessionTier, context: usize) -> Result<ChatSession<'m>> {
        ChatSession::in_runtime(&Runtime::open(model, tier.backend, &tier.gpu)?, context)
    }

    /// An empty session of at most `context` positions in `runtime`, sharing its weights with
    /// the runtime's other sessions.
    pub fn in_runtime(runtime: &Runtime<'m>, context: usize) -> Result<ChatSession<'m>> {
        // Caches that keep every position: a turn may cut them back anywhere.
        let session = runtime.session(context, true)?;
        Ok(ChatSession::on(runtime.model(), session, context))
    }

    fn on(model: &'m Model, session: FallbackSession<'m>, context: usize) -> ChatSession<'m> {
        ChatSession {
            model,
            session,
            context,
            tokens: Vec::new(),
            logits: None,
        }
    }

    /// The tier running the session (its counters and placement for statistics).
    pub fn tier(&self) -> &FallbackSession<'m> {
        &self.session
    }

    pub fn position(&self) -> usize {
        self.tokens.len()
    }

    pub fn context(&self) -> usize {
        self.context
    }

    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    pub fn reset(&mut self) {
        if let Err(e) = self.session.truncate(0) {
            // Both tiers keep every position here: this cannot happen.
            log::error!("resetting a chat session: {e}");
        }
        self.tokens.clear();
        self.logits = None;
    }

    /// Checks that keeping `keep` positions then feeding `ids` is possible, touching nothing.
    pub fn check_extend(&self, keep: usize, ids: &[u32]) -> Result<()> {
        if keep > self.position() {
            return Err(Error::InvalidArgument(format!(
                "keep {keep} is beyond the session's {} positions",
                self.position()
            )));
        }
        if ids.is_empty() {
            // Only a continuation of everything held has logits to go on from.
            if keep != self.position() || self.logits.is_none() {
                return Err(Error::InvalidArgument(
                    "no new tokens to compute logits from".into(),
                ));
            }
            return Ok(());
        }
        super::generate::validate_tokens(&self.model.config, keep, ids, self.context())
    }

    /// Keeps the first `keep` positions, then computes `ids` after them.
    pub fn extend(&mut self, keep: usize, ids: &[u32]) -> Result<()> {
        self.check_extend(keep, ids)?;
        if ids.is_empty() {
            return Ok(()); // keep == position: the logits stand.
        }
        self.session.truncate(keep)?;
        self.tokens.truncate(keep);
        // On failure the session is empty rather than half-written.
        match self.session.feed_logits(ids) {
            Ok(logits) => {
                self.tokens.extend_from_slice(ids);
                self.logits = Some(logits);
                Ok(())
            }
            Err(e) => {
                self.reset();
                Err(e)
            }
        }
    }

    /// Feeds a whole conversation's ids: keeps their longest common prefix with what the cache
    /// holds and computes the rest (at least the last token, for its logits). Returns how many
    /// positions were reused.
    pub fn feed(&mut self, ids: &[u32]) -> Result<usize> {
        let common = self
            .tokens
            .iter()
            .zip(ids)
            .take_while(|(a, b)| a == b)
            .count();
        let keep = common.min(ids.len().saturating_sub(1));
        self.extend(keep, &ids[keep..])?;
        Ok(keep)
    }

    /// Samples up to `max_new` tokens, feeding each one back, and stops after a token in
    /// `stops` (it is fed too), at `max_new`, when the cache is full, or when `emit` returns
    /// false. Returns the emitted tokens and why it ended.
    pub fn generate(
        &mut self,
        max_new: usize,
        sampler: &mut Sampler,
        stops: &[u32],
        mut emit: impl FnMut(u32) -> bool,
    ) -> Result<(Vec<u32>, Finish)> {
        let mut out = Vec::new();
        loop {
            if out.len() >= max_new {
                return Ok((out, Finish::MaxTokens));
            }
            if self.position() >= self.context() {
                return Ok((out, Finish::ContextFull));
            }
            let Some(logits) = &self.logits else {
                return Err(Error::InvalidArgument("nothing to continue from".into()));
            };
            let token = sampler.sample(logits, &self.tokens);
            out.push(token);
            let keep_going = emit(token);
            let position = self.position();
            self.extend(position, &[token])?;
            if stops.contains(&token) {
                return Ok((out, Finish::Stop(token)));
            }
            if !keep_going {
                return Ok((out, Finish::Cancelled));
            }
        }
    }
}

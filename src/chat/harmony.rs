//! Rendering conversations into Harmony token ids, as OpenAI's openai-harmony package does for
//! GPT-OSS (`fixtures/harmony/` holds its output for a set of conversations; the tests render
//! the same conversations and compare ids).
//!
//! A message is `<|start|>{header}<|message|>{content}{end}`: the header is the author (with
//! ` to={recipient}` when addressed), then `<|channel|>{channel}` and a content type when set;
//! the end is `<|call|>` for an assistant's tool call and `<|end|>` otherwise. Text is encoded
//! as plain text between the special tokens, so message content can never inject one.

use serde::{Deserialize, Serialize};

use super::tokenizer::{CALL, CHANNEL, END, MESSAGE, START, Tokenizer};

/// The model identity openai-harmony's system message has by default.
pub const DEFAULT_MODEL_IDENTITY: &str =
    "You are ChatGPT, a large language model trained by OpenAI.";
/// The knowledge cutoff openai-harmony's system message has by default.
pub const DEFAULT_KNOWLEDGE_CUTOFF: &str = "2024-06";
/// The channels an assistant message may use.
pub const DEFAULT_CHANNELS: [&str; 3] = ["analysis", "commentary", "final"];

/// How much the model reasons before answering.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ReasoningEffort {
    Low,
    #[default]
    Medium,
    High,
}

impl ReasoningEffort {
    fn name(self) -> &'static str {
        match self {
            ReasoningEffort::Low => "low",
            ReasoningEffort::Medium => "medium",
            ReasoningEffort::High => "high",
        }
    }
}

/// The system message's settings; absent ones take openai-harmony's defaults.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct SystemSettings {
    #[serde(default)]
    pub model_identity: Option<String>,
    #[serde(default)]
    pub reasoning_effort: Option<ReasoningEffort>,
    #[serde(default)]
    pub knowledge_cutoff: Option<String>,
    /// The date the conversation happens (`YYYY-MM-DD`); absent: no date line.
    #[serde(default)]
    pub conversation_start_date: Option<String>,
    #[serde(default)]
    pub channels: Option<Vec<String>>,
}

/// A function the model may call: its JSON-schema parameters render as a TypeScript type.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct FunctionTool {
    pub name: String,
    #[serde(default)]
    pub description: String,
    #[serde(default)]
    pub parameters: Option<serde_json::Value>,
}

/// The developer message: instructions and function tools.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct DeveloperSettings {
    #[serde(default)]
    pub instructions: Option<String>,
    #[serde(default)]
    pub tools: Vec<FunctionTool>,
}

/// Who wrote a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    User,
    Assistant,
    /// A tool's result; the message's `name` is the tool (`functions.NAME`).
    Tool,
}

/// One message after the system and developer messages.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: Role,
    pub content: String,
    #[serde(default)]
    pub channel: Option<String>,
    /// Who the message is addressed to (an assistant's tool call: `functions.NAME`).
    #[serde(default)]
    pub recipient: Option<String>,
    /// e.g. `<|constrain|>json` for a tool call's arguments.
    #[serde(default)]
    pub content_type: Option<String>,
    /// A tool message's author (`functions.NAME`).
    #[serde(default)]
    pub name: Option<String>,
}

/// A whole conversation: optional system and developer messages, then the rest.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Conversation {
    #[serde(default)]
    pub system: Option<SystemSettings>,
    #[serde(default)]
    pub developer: Option<DeveloperSettings>,
    pub messages: Vec<ChatMessage>,
}

/// Today's date (UTC) as `YYYY-MM-DD`, for the Harmony system message.
pub fn today() -> String {
    let seconds = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let days = (seconds / 86_400) as i64;
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}")
}

/// Rendered pieces: special tokens and text, text encoded run by run.
enum Piece {
    Special(u32),
    Text(String),
}

struct Rendered {
    pieces: Vec<Piece>,
}

impl Rendered {
    fn special(&mut self, id: u32) {
        self.pieces.push(Piece::Special(id));
    }

    fn text(&mut self, text: &str) {
        match self.pieces.last_mut() {
            Some(Piece::Text(run)) => run.push_str(text),
            _ => self.pieces.push(Piece::Text(text.to_string())),
        }
    }

    /// `<|start|>{header}<|message|>{content}{end}`.
    fn message(&mut self, header: &str, channel: Option<&str>, content_type: Option<&str>) {
        self.special(START);
        self.text(header);
        if let Some(channel) = channel {
            self.special(CHANNEL);
            self.text(channel);
        }
        if let Some(content_type) = content_type {
            self.text(" ");
            // A content type may start with `<|constrain|>`: that is the special token.
            match content_type.strip_prefix("<|constrain|>") {
                Some(rest) => {
                    self.special(super::tokenizer::CONSTRAIN);
                    self.text(rest);
                }
                None => self.text(content_type),
            }
        }
        self.special(MESSAGE);
    }

    fn ids(&self, tokenizer: &Tokenizer) -> Vec<u32> {
        let mut ids = Vec::new();
        for piece in &self.pieces {
            match piece {
                Piece::Special(id) => ids.push(*id),
                Piece::Text(text) => ids.extend(tokenizer.encode(text)),
            }
        }
        ids
    }
}

/// The system message's text.
fn system_text(settings: &SystemSettings, has_functions: bool) -> String {
    let mut text = settings
        .model_identity
        .clone()
        .unwrap_or_else(|| DEFAULT_MODEL_IDENTITY.to_string());
    text.push_str("\nKnowledge cutoff: ");
    text.push_str(
        settings
            .knowledge_cutoff
            .as_deref()
            .unwrap_or(DEFAULT_KNOWLEDGE_CUTOFF),
    );
    if let Some(date) = &settings.conversation_start_date {
        text.push_str("\nCurrent date: ");
        text.push_str(date);
    }
    text.push_str("\n\nReasoning: ");
    text.push_str(settings.reasoning_effort.unwrap_or_default().name());
    let channels: Vec<&str> = match &settings.channels {
        Some(c) => c.iter().map(String::as_str).collect(),
        None => DEFAULT_CHANNELS.to_vec(),
    };
    if !channels.is_empty() {
        text.push_str("\n\n# Valid channels: ");
        text.push_str(&channels.join(", "));
        text.push_str(". Channel must be included for every message.");
    }
    if has_functions {
        text.push_str("\nCalls to these tools must go to the commentary channel: 'functions'.");
    }
    text
}

/// The developer message's text.
fn developer_text(settings: &DeveloperSettings) -> String {
    let mut sections = Vec::new();
    if let Some(instructions) = &settings.instructions {
        sections.push(format!("# Instructions\n\n{instructions}"));
    }
    if !settings.tools.is_empty() {
        let mut tools = String::from("# Tools\n\n## functions\n\nnamespace functions {\n\n");
        for tool in &settings.tools {
            if !tool.description.is_empty() {
                for line in tool.description.lines() {
                    tools.push_str(&format!("// {line}\n"));
                }
            }
            let signature = match &tool.parameters {
                Some(schema) if schema.get("properties").is_some() => {
                    format!("(_: {}) => any", object_type(schema))
                }
                _ => "() => any".to_string(),
            };
            tools.push_str(&format!("type {} = {signature};\n\n", tool.name));
        }
        tools.push_str("} // namespace functions");
        sections.push(tools);
    }
    sections.join("\n\n")
}

/// A JSON-schema object as a TypeScript object type, one property per line: its description
/// as a comment above it, `?` when not required, its default as a comment after it.
fn object_type(schema: &serde_json::Value) -> String {
    let required: Vec<&str> = schema["required"]
        .as_array()
        .map(|r| r.iter().filter_map(|v| v.as_str()).collect())
        .unwrap_or_default();
    let mut out = String::from("{\n");
    if let Some(properties) = schema["properties"].as_object() {
        for (name, property) in properties {
            if let Some(description) = property["description"].as_str() {
                for line in description.lines() {
                    out.push_str(&format!("// {line}\n"));
                }
            }
            let optional = if required.contains(&name.as_str()) {
                ""
            } else {
                "?"
            };
            out.push_str(&format!("{name}{optional}: {},", value_type(property)));
            if let Some(default) = property.get("default") {
                let shown = match default {
                    serde_json::Value::String(s) => s.clone(),
                    other => other.to_string(),
                };
                out.push_str(&format!(" // default: {shown}"));
            }
            out.push('\n');
        }
    }
    out.push('}');
    out
}

/// A JSON-schema value as a TypeScript type.
fn value_type(schema: &serde_json::Value) -> String {
    if let Some(values) = schema["enum"].as_array() {
        return values
            .iter()
            .map(|v| v.to_string())
            .collect::<Vec<_>>()
            .join(" | ");
    }
    match schema["type"].as_str() {
        Some("string") => "string".into(),
        Some("integer") | Some("number") => "number".into(),
        Some("boolean") => "boolean".into(),
        Some("null") => "null".into(),
        Some("array") => format!("{}[]", value_type(&schema["items"])),
        Some("object") if schema.get("properties").is_some() => object_type(schema),
        _ => "any".into(),
    }
}

impl Conversation {
    /// The ids of the conversation followed by `<|start|>assistant`: what the model completes.
    /// An assistant's `analysis` messages before its last `final` one are dropped, as
    /// openai-harmony does (the reasoning of finished turns is not shown to the model again).
    pub fn render_for_completion(&self, tokenizer: &Tokenizer) -> Vec<u32> {
        let mut out = Rendered { pieces: Vec::new() };
        let has_functions = self.developer.as_ref().is_some_and(|d| !d.tools.is_empty());
        if let Some(system) = &self.system {
            out.message("system", None, None);
            out.text(&system_text(system, has_functions));
            out.special(END);
        }
        if let Some(developer) = &self.developer {
            out.message("developer", None, None);
            out.text(&developer_text(developer));
            out.special(END);
        }
        let last_final = self
            .messages
            .iter()
            .rposition(|m| m.role == Role::Assistant && m.channel.as_deref() == Some("final"));
        for (i, m) in self.messages.iter().enumerate() {
            let dropped = m.role == Role::Assistant
                && m.channel.as_deref() == Some("analysis")
                && last_final.is_some_and(|f| i < f);
            if dropped {
                continue;
            }
            let header = match m.role {
                Role::User => "user".to_string(),
                Role::Assistant => match &m.recipient {
                    Some(to) => format!("assistant to={to}"),
                    None => "assistant".to_string(),
                },
                Role::Tool => {
                    let name = m.name.as_deref().unwrap_or("functions");
                    format!(
                        "{name} to={}",
                        m.recipient.as_deref().unwrap_or("assistant")
                    )
                }
            };
            out.message(&header, m.channel.as_deref(), m.content_type.as_deref());
            out.text(&m.content);
            let tool_call = m.role == Role::Assistant && m.recipient.is_some();
            out.special(if tool_call { CALL } else { END });
        }
        out.special(START);
        out.text("assistant");
        out.ids(tokenizer)
    }
}

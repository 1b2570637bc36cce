//! `picchio --help` and every command's `--help` against docs/cli.md: each flag the help prints
//! has a description there, is described in its command's section of docs/cli.md with its default,
//! and every flag docs/cli.md names exists.

mod common;

use std::collections::BTreeSet;

/// `picchio args... --help`'s stdout.
fn help(args: &[&str]) -> String {
    common::picchio_stdout(&[args, &["--help"]].concat())
}

/// Whether `c` can be part of a long flag's name.
fn is_flag_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '-'
}

fn indent(line: &str) -> usize {
    line.len() - line.trim_start().len()
}

/// The commands the top-level help lists under "Commands:", without `help`.
fn commands(top: &str) -> Vec<String> {
    top.lines()
        .skip_while(|l| l.trim() != "Commands:")
        .skip(1)
        .take_while(|l| !l.trim().is_empty())
        .filter(|l| indent(l) == 2)
        .map(|l| l.split_whitespace().next().unwrap().to_string())
        .filter(|name| name != "help")
        .collect()
}

/// One option of a help text: its long name (without `--`), its default as the help prints it,
/// and its description with the default and the possible values left out.
#[derive(Debug)]
struct Flag {
    name: String,
    default: Option<String>,
    description: String,
}

/// The long flag an option line of a help text starts with (`  -h, --help  Print help` or
/// `      --model <DIR>`), and the rest of the line after the flag and its value.
fn option_line(line: &str) -> Option<(String, String)> {
    // clap indents options by 2 (with a short flag) or 6; descriptions and values go deeper.
    if !(1..=6).contains(&indent(line)) {
        return None;
    }
    let text = line.trim_start();
    let text = match text.strip_prefix('-') {
        Some(rest) if !rest.starts_with('-') => rest.get(1..)?.strip_prefix(", ")?,
        _ => text,
    };
    let long = text.strip_prefix("--")?;
    let name: String = long.chars().take_while(|c| is_flag_char(*c)).collect();
    if name.is_empty() {
        return None;
    }
    // The signature (`--ids <IDS>...`) ends where two spaces start the description.
    let rest = text.find("  ").map_or("", |i| &text[i..]);
    Some((name, rest.to_string()))
}

/// `text` without its `[label: ...]` groups; the default's value, if there was one.
fn strip_brackets(text: &str) -> (String, Option<String>) {
    let mut out = String::new();
    let mut default = None;
    let mut rest = text;
    while let Some(start) = rest.find('[') {
        let Some(len) = rest[start..].find(']') else {
            break;
        };
        let group = &rest[start + 1..start + len];
        let labelled = ["default: ", "possible values: ", "aliases: ", "env: "]
            .iter()
            .find(|label| group.starts_with(**label));
        out.push_str(&rest[..start]);
        match labelled {
            Some(label) => {
                if *label == "default: " {
                    default = Some(group[label.len()..].to_string());
                }
            }
            None => out.push_str(&rest[start..=start + len]),
        }
        rest = &rest[start + len + 1..];
    }
    out.push_str(rest);
    (out, default)
}

/// Every option of a help text, in either of clap's layouts (the description on the flag's line,
/// or on the lines below it).
fn options(help: &str) -> Vec<Flag> {
    let lines: Vec<&str> = help.lines().collect();
    let mut flags = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let Some((name, rest)) = option_line(line) else {
            continue;
        };
        let mut text = vec![rest];
        for next in &lines[i + 1..] {
            if option_line(next).is_some() || (indent(next) == 0 && !next.trim().is_empty()) {
                break;
            }
            text.push(next.to_string());
        }
        // Value lists ("Possible values:" and its "- value: ..." lines) describe the values.
        let text: Vec<String> = text
            .iter()
            .map(|l| l.trim().to_string())
            .filter(|l| !l.starts_with("Possible values:") && !l.starts_with("- "))
            .collect();
        let (description, default) = strip_brackets(&text.join(" "));
        flags.push(Flag {
            name,
            default,
            description: description.trim().to_string(),
        });
    }
    flags
}

/// The `##`/`###` sections of a markdown text: (heading line, the heading and its body).
fn sections(doc: &str) -> Vec<(String, String)> {
    let mut sections: Vec<(String, String)> = Vec::new();
    let mut in_code = false;
    for line in doc.lines() {
        if line.trim_start().starts_with("```") {
            in_code = !in_code;
        }
        if !in_code && (line.starts_with("## ") || line.starts_with("### ")) {
            sections.push((line.to_string(), String::new()));
        }
        if let Some((_, body)) = sections.last_mut() {
            body.push_str(line);
            body.push('\n');
        }
    }
    sections
}

/// Where `text` names `--flag` as a whole flag (`--prefetch` is not in `--prefetch-proxy`): the
/// byte offsets just after each mention.
fn mentions(text: &str, flag: &str) -> Vec<usize> {
    let needle = format!("--{flag}");
    text.match_indices(&needle)
        .filter(|(at, _)| !text[..*at].ends_with(is_flag_char))
        .map(|(at, _)| at + needle.len())
        .filter(|end| !text[*end..].starts_with(is_flag_char))
        .collect()
}

/// Every `--flag` a text names.
fn flags_named(text: &str) -> BTreeSet<String> {
    let mut named = BTreeSet::new();
    for (at, _) in text.match_indices("--") {
        if text[..at].ends_with(is_flag_char) {
            continue;
        }
        let name: String = text[at + 2..]
            .chars()
            .take_while(|c| is_flag_char(*c))
            .collect();
        if name.starts_with(|c: char| c.is_ascii_lowercase()) {
            named.insert(name);
        }
    }
    named
}

/// Whether a mention of `--flag` in `section` gives its default within the text that follows
/// (e.g. "`--max-new-tokens N` (default 32, tokens)" or "`--mmap` (default `auto`)").
fn documents_default(section: &str, flag: &str, default: &str) -> bool {
    mentions(section, flag).into_iter().any(|end| {
        let window: String = section[end..].chars().take(160).collect();
        window.find("default").is_some_and(|at| {
            let after = &window[at + "default".len()..];
            after
                .trim_start_matches(|c: char| c.is_whitespace() || c == ':' || c == '`')
                .starts_with(default)
        })
    })
}

#[test]
fn every_flag_of_every_help_is_in_docs_cli_md() {
    let doc_path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/cli.md");
    let doc = std::fs::read_to_string(&doc_path).unwrap();
    let sections = sections(&doc);
    let mut problems = Vec::new();

    let top = help(&[]);
    let commands = commands(&top);
    assert!(
        commands.len() >= 12,
        "expected the top-level help to list every command, got {commands:?} from:\n{top}"
    );

    // The global options (`--threads`, `--help`, `--version`): described once, in their section.
    let global_flags = options(&top);
    assert!(global_flags.iter().any(|f| f.name == "threads"), "{top}");
    let global: BTreeSet<String> = global_flags.iter().map(|f| f.name.clone()).collect();
    let global_section = sections
        .iter()
        .find(|(heading, _)| heading.trim() == "## Global options")
        .map(|(_, body)| body.as_str());
    if global_section.is_none() {
        problems.push("docs/cli.md: no \"## Global options\" section".to_string());
    }
    for flag in &global_flags {
        if flag.description.is_empty() {
            problems.push(format!(
                "picchio --help: --{} has no description",
                flag.name
            ));
        }
        if let Some(section) = global_section
            && mentions(section, &flag.name).is_empty()
        {
            problems.push(format!(
                "picchio: --{} is not in docs/cli.md's Global options",
                flag.name
            ));
        }
    }

    // The synopsis at the top of the file names every command.
    let synopsis = doc.split("```").nth(1).unwrap_or("");
    let mut checked = 0;
    let mut every_flag: BTreeSet<String> = global.clone();
    for command in &commands {
        if !synopsis.contains(&format!("picchio {command} ")) {
            problems.push(format!(
                "{command}: not in the synopsis at the top of docs/cli.md"
            ));
        }
        // Its section(s): "### `picchio serve`" and "### `picchio serve --stdio`" for serve,
        // "### `picchio convert` and `picchio verify`" for both.
        let section: String = sections
            .iter()
            .filter(|(heading, _)| {
                heading.starts_with("### ")
                    && (heading.contains(&format!("`picchio {command}`"))
                        || heading.contains(&format!("`picchio {command} ")))
            })
            .map(|(_, body)| body.as_str())
            .collect();
        if section.is_empty() {
            problems.push(format!(
                "{command}: no \"### `picchio {command}`\" section in docs/cli.md"
            ));
        }
        let text = help(&[command]);
        let flags = options(&text);
        assert!(
            flags.iter().any(|f| f.name == "help"),
            "no options parsed from picchio {command} --help:\n{text}"
        );
        for flag in &flags {
            every_flag.insert(flag.name.clone());
            checked += 1;
            if flag.description.is_empty() {
                problems.push(format!(
                    "{command}: --{} has no description in --help",
                    flag.name
                ));
            }
            if global.contains(&flag.name) {
                continue;
            }
            if mentions(&doc, &flag.name).is_empty() {
                problems.push(format!("{command}: --{} is not in docs/cli.md", flag.name));
            } else if mentions(&section, &flag.name).is_empty() {
                problems.push(format!(
                    "{command}: --{} is not in the section of picchio {command} in docs/cli.md",
                    flag.name
                ));
            } else if let Some(default) = &flag.default
                && !documents_default(&section, &flag.name, default)
            {
                problems.push(format!(
                    "{command}: --{}'s default ({default}) is not given after it in its section \
                     of docs/cli.md (as \"(default {default})\")",
                    flag.name
                ));
            }
        }
    }
    assert!(checked > 100, "only {checked} flags checked");

    // And the other way: every flag docs/cli.md names is one some --help prints.
    for named in flags_named(&doc) {
        if !every_flag.contains(&named) {
            problems.push(format!(
                "docs/cli.md names --{named}, which no picchio --help prints"
            ));
        }
    }

    assert!(
        problems.is_empty(),
        "docs/cli.md and picchio's --help disagree ({} problems):\n{}",
        problems.len(),
        problems.join("\n")
    );
}

#[test]
fn the_help_parser_reads_both_of_clap_layouts() {
    let same_line =
        "Options:\n      --seed <S>   Seed of the prompt [default: 0]\n  -h, --help   Print help\n";
    let flags = options(same_line);
    assert_eq!(flags.len(), 2, "{flags:?}");
    assert_eq!(flags[0].name, "seed");
    assert_eq!(flags[0].default.as_deref(), Some("0"));
    assert_eq!(flags[0].description, "Seed of the prompt");
    assert_eq!(flags[1].name, "help");

    let next_line = "Options:\n      --backend <BACKEND>\n          Possible values:\n          \
                     - cpu:  The CPU tier\n          \n          [default: auto]\n\n      \
                     --stats\n          Add statistics\n\n  -h, --help\n          Print help\n";
    let flags = options(next_line);
    assert_eq!(flags.len(), 3, "{flags:?}");
    assert_eq!(flags[0].name, "backend");
    assert_eq!(flags[0].default.as_deref(), Some("auto"));
    assert_eq!(
        flags[0].description, "",
        "value lists are not a description"
    );
    assert_eq!(flags[1].description, "Add statistics");

    assert_eq!(
        mentions("`--prefetch-proxy a|b`", "prefetch"),
        Vec::<usize>::new()
    );
    assert_eq!(mentions("`--prefetch on|off`", "prefetch").len(), 1);
    assert!(documents_default(
        "`--mmap` (default `auto`)",
        "mmap",
        "auto"
    ));
    assert!(!documents_default(
        "`--mmap`: where weights live",
        "mmap",
        "auto"
    ));
}

/// The README's Quick start runs `generate` on a shipped fixture and says what it prints: the
/// command as written there must print exactly that, on whichever tier this machine runs it.
#[test]
fn the_readme_quick_start_prints_what_the_readme_says() {
    let readme_path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md");
    let readme = std::fs::read_to_string(readme_path).unwrap();
    let sections = sections(&readme);
    let (_, section) = sections
        .iter()
        .find(|(heading, _)| heading.trim() == "## Quick start")
        .expect("README.md has a Quick start section");
    let command = section
        .lines()
        .find_map(|line| line.trim().strip_prefix("cargo run --release -- "))
        .expect("the Quick start runs `cargo run --release -- ...`");
    let prose = section.replace('\n', " ");
    let promised = prose
        .split("prints the ids on stdout, `")
        .nth(1)
        .and_then(|rest| rest.split('`').next())
        .expect("the Quick start says which ids the command prints");
    let args: Vec<&str> = command.split_whitespace().collect();
    assert_eq!(common::picchio_stdout(&args).trim(), promised);
}

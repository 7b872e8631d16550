//! Tokens of a PTX file, with their line numbers.

use crate::error::{Error, Result};

/// A token's kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Tok<'a> {
    /// A name: directives (`.reg`), opcodes (`mma.sync...`), registers (`%rd3`,
    /// `%tid.x`), labels (`$L__BB0_1`), symbols and the sink `_`.
    Ident(&'a str),
    /// An integer literal (decimal or `0x`), without its sign.
    Int(u64),
    /// `0fXXXXXXXX`: the bits of an `f32`.
    F32(u32),
    /// `0dXXXXXXXXXXXXXXXX`: the bits of an `f64`.
    F64(u64),
    /// One punctuation character: `{ } ( ) [ ] , ; : + - @ ! = < >`.
    Punct(char),
}

/// A token and the line it is on (1-based).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Token<'a> {
    pub(crate) tok: Tok<'a>,
    pub(crate) line: u32,
}

fn ident_start(c: u8) -> bool {
    c.is_ascii_alphabetic() || matches!(c, b'_' | b'$' | b'%' | b'.')
}

fn ident_char(c: u8) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, b'_' | b'$' | b'.')
}

/// Splits `src` into tokens; `file` names it in errors.
pub(crate) fn lex<'a>(file: &str, src: &'a str) -> Result<Vec<Token<'a>>> {
    let b = src.as_bytes();
    let mut out = Vec::with_capacity(src.len() / 4);
    let (mut i, mut line) = (0usize, 1u32);
    while i < b.len() {
        let c = b[i];
        match c {
            b'\n' => {
                line += 1;
                i += 1;
            }
            _ if c.is_ascii_whitespace() => i += 1,
            b'/' if b.get(i + 1) == Some(&b'/') => {
                while i < b.len() && b[i] != b'\n' {
                    i += 1;
                }
            }
            b'/' if b.get(i + 1) == Some(&b'*') => {
                i += 2;
                while i + 1 < b.len() && !(b[i] == b'*' && b[i + 1] == b'/') {
                    if b[i] == b'\n' {
                        line += 1;
                    }
                    i += 1;
                }
                i += 2;
            }
            _ if c.is_ascii_digit() => {
                let start = i;
                while i < b.len() && b[i].is_ascii_alphanumeric() {
                    i += 1;
                }
                let text = &src[start..i];
                let bad = || Error::parse(file, line, format!("bad number `{text}`"));
                let tok = if let Some(h) = text.strip_prefix("0f").or(text.strip_prefix("0F")) {
                    if h.len() != 8 {
                        return Err(bad());
                    }
                    Tok::F32(u32::from_str_radix(h, 16).map_err(|_| bad())?)
                } else if let Some(h) = text.strip_prefix("0d").or(text.strip_prefix("0D")) {
                    if h.len() != 16 {
                        return Err(bad());
                    }
                    Tok::F64(u64::from_str_radix(h, 16).map_err(|_| bad())?)
                } else if let Some(h) = text.strip_prefix("0x").or(text.strip_prefix("0X")) {
                    Tok::Int(u64::from_str_radix(h.trim_end_matches('U'), 16).map_err(|_| bad())?)
                } else {
                    Tok::Int(text.trim_end_matches('U').parse().map_err(|_| bad())?)
                };
                out.push(Token { tok, line });
            }
            _ if ident_start(c) => {
                let start = i;
                i += 1;
                while i < b.len() && ident_char(b[i]) {
                    i += 1;
                }
                out.push(Token {
                    tok: Tok::Ident(&src[start..i]),
                    line,
                });
            }
            b'{' | b'}' | b'(' | b')' | b'[' | b']' | b',' | b';' | b':' | b'+' | b'-' | b'@'
            | b'!' | b'=' | b'<' | b'>' => {
                out.push(Token {
                    tok: Tok::Punct(c as char),
                    line,
                });
                i += 1;
            }
            _ => {
                return Err(Error::parse(
                    file,
                    line,
                    format!("unexpected character {:?}", c as char),
                ));
            }
        }
    }
    Ok(out)
}

//! The parser: what rustc's NVPTX backend emits for pagedkv's kernels, and nothing
//! else. Anything outside that subset is an error naming the file, the line and the
//! construct; nothing is skipped.

use std::collections::HashMap;

use crate::error::{Error, Result};
use crate::ir::*;
use crate::lex::{Tok, Token, lex};

/// One `.param` of a function: its name, offset in the parameter buffer, size and
/// alignment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ParamDecl {
    pub(crate) name: String,
    pub(crate) offset: u64,
    pub(crate) size: u64,
    pub(crate) align: u64,
}

/// A function of the module: an entry point or a `.func`.
#[derive(Clone, Debug)]
pub(crate) struct Function {
    pub(crate) name: String,
    pub(crate) is_entry: bool,
    pub(crate) noreturn: bool,
    pub(crate) params: Vec<ParamDecl>,
    /// `.maxntid`, if declared.
    pub(crate) maxntid: Option<[u32; 3]>,
    pub(crate) nregs: u32,
    pub(crate) code: Vec<Inst>,
    /// The instruction index of every basic block's first instruction (the entry,
    /// every label, and every instruction after a branch), sorted.
    pub(crate) blocks: Vec<u32>,
}

/// A `.global` data array, in host memory for the module's lifetime.
#[derive(Debug)]
pub(crate) struct GlobalData {
    /// 8-byte aligned storage (boxed: its address never moves).
    pub(crate) words: Box<[u64]>,
    pub(crate) bytes: u64,
}

impl GlobalData {
    pub(crate) fn addr(&self) -> u64 {
        self.words.as_ptr() as u64
    }
}

/// A parsed PTX module.
#[derive(Debug)]
pub(crate) struct Parsed {
    pub(crate) target: String,
    pub(crate) funcs: Vec<Function>,
    pub(crate) globals: Vec<GlobalData>,
}

/// An operand as written, before its instruction gives it a type.
#[derive(Clone, Debug, PartialEq)]
enum Opnd<'a> {
    Name(&'a str),
    Int(i128),
    F32(u32),
    F64(u64),
    Addr(&'a str, i64),
    Vec(Vec<Opnd<'a>>),
    List(Vec<&'a str>),
}

/// The type an operand is encoded as.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Ty {
    Pred,
    B16,
    B32,
    B64,
    F32,
}

impl Ty {
    fn bits(self) -> u32 {
        match self {
            Ty::Pred => 1,
            Ty::B16 => 16,
            Ty::B32 | Ty::F32 => 32,
            Ty::B64 => 64,
        }
    }
    fn mask(self) -> u64 {
        match self.bits() {
            64 => u64::MAX,
            n => (1u64 << n) - 1,
        }
    }
}

/// The type an arithmetic, logic or conversion instruction `opc` writes: a predicate
/// for `setp`, the wide product for `mul.wide`, the first type of a `cvt` (its
/// destination's), else the last type in the opcode.
fn dst_ty(opc: &str) -> Option<Ty> {
    let ty_of = |t: &str| {
        Some(match t {
            "pred" => Ty::Pred,
            "b16" | "u16" | "s16" | "f16" | "bf16" | "e4m3x2" | "e5m2x2" => Ty::B16,
            "b32" | "u32" | "s32" | "f16x2" | "bf16x2" => Ty::B32,
            "f32" => Ty::F32,
            "b64" | "u64" | "s64" => Ty::B64,
            _ => return None,
        })
    };
    match opc {
        "mul.wide.u16" => return Some(Ty::B32),
        "mul.wide.u32" => return Some(Ty::B64),
        _ if opc.starts_with("setp.") => return Some(Ty::Pred),
        _ => {}
    }
    let mut types = opc.split('.').filter_map(ty_of);
    if opc.starts_with("cvt.") {
        types.next()
    } else {
        types.next_back()
    }
}

struct Parser<'a, 'f> {
    file: &'f str,
    toks: Vec<Token<'a>>,
    pos: usize,
    shared_syms: Vec<&'a str>,
    globals: Vec<GlobalData>,
    global_index: HashMap<String, usize>,
    funcs: Vec<Function>,
    func_index: HashMap<String, usize>,
}

/// Parses `src`, the text of a PTX file named `file` (for errors).
pub(crate) fn parse(file: &str, src: &str) -> Result<Parsed> {
    let toks = lex(file, src)?;
    let mut p = Parser {
        file,
        toks,
        pos: 0,
        shared_syms: Vec::new(),
        globals: Vec::new(),
        global_index: HashMap::new(),
        funcs: Vec::new(),
        func_index: HashMap::new(),
    };
    let target = p.module()?;
    Ok(Parsed {
        target,
        funcs: p.funcs,
        globals: p.globals,
    })
}

impl<'a> Parser<'a, '_> {
    fn line(&self) -> u32 {
        self.toks
            .get(self.pos)
            .or(self.toks.last())
            .map_or(0, |t| t.line)
    }

    fn err<T>(&self, msg: impl Into<String>) -> Result<T> {
        Err(Error::parse(self.file, self.line(), msg))
    }

    fn peek(&self) -> Option<Tok<'a>> {
        self.toks.get(self.pos).map(|t| t.tok)
    }

    fn next(&mut self) -> Result<Tok<'a>> {
        match self.toks.get(self.pos) {
            Some(t) => {
                self.pos += 1;
                Ok(t.tok)
            }
            None => self.err("unexpected end of file"),
        }
    }

    fn eat(&mut self, c: char) -> bool {
        if self.peek() == Some(Tok::Punct(c)) {
            self.pos += 1;
            true
        } else {
            false
        }
    }

    fn expect(&mut self, c: char) -> Result<()> {
        if self.eat(c) {
            Ok(())
        } else {
            self.err(format!("expected `{c}`, found {:?}", self.peek()))
        }
    }

    fn ident(&mut self) -> Result<&'a str> {
        match self.next()? {
            Tok::Ident(s) => Ok(s),
            t => {
                self.pos -= 1;
                self.err(format!("expected a name, found {t:?}"))
            }
        }
    }

    fn int(&mut self) -> Result<u64> {
        match self.next()? {
            Tok::Int(v) => Ok(v),
            t => {
                self.pos -= 1;
                self.err(format!("expected an integer, found {t:?}"))
            }
        }
    }

    /// Skips the rest of the current line (for `.version` and friends).
    fn skip_line(&mut self) {
        let line = self.toks[self.pos - 1].line;
        while self.toks.get(self.pos).is_some_and(|t| t.line == line) {
            self.pos += 1;
        }
    }

    fn module(&mut self) -> Result<String> {
        let mut target = None;
        while let Some(tok) = self.peek() {
            let Tok::Ident(d) = tok else {
                return self.err(format!("unexpected {tok:?} at module level"));
            };
            self.pos += 1;
            match d {
                ".version" => self.skip_line(),
                ".address_size" => {
                    let bits = self.int()?;
                    if bits != 64 {
                        return self.err(format!("`.address_size {bits}`: only 64 is supported"));
                    }
                }
                ".target" => {
                    target = Some(self.ident()?.to_string());
                    while self.eat(',') {
                        self.ident()?;
                    }
                }
                ".extern" => {
                    let what = self.ident()?;
                    if what != ".shared" {
                        return self.err(format!("unsupported `.extern {what}`"));
                    }
                    self.shared_decl()?;
                }
                ".global" => self.global_decl()?,
                ".visible" => {
                    let kind = self.ident()?;
                    match kind {
                        ".entry" => self.function(true)?,
                        ".func" => self.function(false)?,
                        _ => return self.err(format!("unsupported `.visible {kind}`")),
                    }
                }
                ".entry" => self.function(true)?,
                ".func" => self.function(false)?,
                _ => return self.err(format!("unsupported module directive `{d}`")),
            }
        }
        match target {
            Some(t) => Ok(t),
            None => Err(Error::parse(self.file, 1, "no `.target`")),
        }
    }

    /// `.extern .shared .align A .b8 NAME[];` (after `.extern .shared`).
    fn shared_decl(&mut self) -> Result<()> {
        if self.ident()? != ".align" {
            return self.err("expected `.align` in a `.shared` declaration");
        }
        self.int()?;
        if self.ident()? != ".b8" {
            return self.err("only `.b8` dynamic shared arrays are supported");
        }
        let name = self.ident()?;
        self.expect('[')?;
        self.expect(']')?;
        self.expect(';')?;
        self.shared_syms.push(name);
        Ok(())
    }

    /// `.global .align A .bN NAME[K] = {...};` (after `.global`).
    fn global_decl(&mut self) -> Result<()> {
        let mut align = 1;
        let mut d = self.ident()?;
        if d == ".align" {
            align = self.int()?;
            d = self.ident()?;
        }
        let elem = match d {
            ".b8" | ".u8" => 1u64,
            ".b16" | ".u16" => 2,
            ".b32" | ".u32" => 4,
            ".b64" | ".u64" => 8,
            _ => return self.err(format!("unsupported `.global` element type `{d}`")),
        };
        if align > 8 {
            return self.err(format!(
                "`.global` alignment {align} above 8 is not supported"
            ));
        }
        let name = self.ident()?;
        self.expect('[')?;
        let count = self.int()?;
        self.expect(']')?;
        let bytes = count
            .checked_mul(elem)
            .filter(|&b| b <= 1 << 20)
            .ok_or_else(|| Error::parse(self.file, self.line(), "`.global` array too large"))?;
        let mut words = vec![0u64; bytes.div_ceil(8) as usize].into_boxed_slice();
        if self.eat('=') {
            self.expect('{')?;
            let mut i = 0u64;
            loop {
                if i >= count {
                    return self.err("more initialisers than elements");
                }
                let v = match self.next()? {
                    Tok::Int(v) if elem == 8 || v >> (8 * elem) == 0 => v,
                    Tok::Int(v) => {
                        return self.err(format!("initialiser {v} does not fit `{d}`"));
                    }
                    Tok::Ident("generic") if elem != 8 => {
                        return self.err(format!(
                            "`generic(..)` in a `{d}` array: addresses are 64-bit"
                        ));
                    }
                    Tok::Ident("generic") => {
                        self.expect('(')?;
                        let sym = self.ident()?;
                        self.expect(')')?;
                        match self.global_index.get(sym) {
                            Some(&g) => self.globals[g].addr(),
                            None => return self.err(format!("`generic({sym})` before `{sym}`")),
                        }
                    }
                    t => return self.err(format!("unsupported initialiser {t:?}")),
                };
                let at = i * elem;
                for k in 0..elem {
                    let byte = (v >> (8 * k)) & 0xFF;
                    words[((at + k) / 8) as usize] |= byte << (8 * ((at + k) % 8));
                }
                i += 1;
                if !self.eat(',') {
                    break;
                }
            }
            self.expect('}')?;
        }
        self.expect(';')?;
        self.global_index
            .insert(name.to_string(), self.globals.len());
        self.globals.push(GlobalData { words, bytes });
        Ok(())
    }

    /// `.param .align A .b8 NAME[N]` or `.param .bN NAME`.
    fn param_decl(&mut self, offset: &mut u64) -> Result<ParamDecl> {
        if self.ident()? != ".param" {
            return self.err("expected `.param`");
        }
        let mut d = self.ident()?;
        let mut align = None;
        if d == ".align" {
            align = Some(self.int()?);
            d = self.ident()?;
        }
        let elem = match d {
            ".b8" | ".u8" => 1u64,
            ".b16" | ".u16" => 2,
            ".b32" | ".u32" | ".f32" => 4,
            ".b64" | ".u64" => 8,
            _ => return self.err(format!("unsupported parameter type `{d}`")),
        };
        let name = self.ident()?.to_string();
        let mut size = elem;
        if self.eat('[') {
            size = elem * self.int()?;
            self.expect(']')?;
        }
        let align = align.unwrap_or(elem);
        if !align.is_power_of_two() {
            return self.err(format!("parameter alignment {align}"));
        }
        let at = offset.next_multiple_of(align);
        *offset = at + size;
        Ok(ParamDecl {
            name,
            offset: at,
            size,
            align,
        })
    }

    fn function(&mut self, is_entry: bool) -> Result<()> {
        let name = self.ident()?.to_string();
        let mut params = Vec::new();
        if self.eat('(') {
            let mut offset = 0;
            if !self.eat(')') {
                loop {
                    params.push(self.param_decl(&mut offset)?);
                    if self.eat(')') {
                        break;
                    }
                    self.expect(',')?;
                }
            }
        }
        let (mut noreturn, mut maxntid) = (false, None);
        loop {
            match self.peek() {
                Some(Tok::Ident(".noreturn")) => {
                    self.pos += 1;
                    noreturn = true;
                }
                Some(Tok::Ident(".maxntid")) => {
                    self.pos += 1;
                    let mut dims = [1u32; 3];
                    for (i, d) in dims.iter_mut().enumerate() {
                        if i > 0 && !self.eat(',') {
                            break;
                        }
                        *d = u32::try_from(self.int()?).map_err(|_| {
                            Error::parse(self.file, self.line(), "`.maxntid` out of range")
                        })?;
                    }
                    maxntid = Some(dims);
                }
                Some(Tok::Ident(d)) if d.starts_with('.') => {
                    return self.err(format!("unsupported function directive `{d}`"));
                }
                _ => break,
            }
        }
        let mut f = Function {
            name: name.clone(),
            is_entry,
            noreturn,
            params,
            maxntid,
            nregs: 0,
            code: Vec::new(),
            blocks: Vec::new(),
        };
        if self.eat(';') {
            // A declaration: the body comes later (or never, for a function only
            // called).
            if !self.func_index.contains_key(&name) {
                self.func_index.insert(name, self.funcs.len());
                self.funcs.push(f);
            }
            return Ok(());
        }
        self.expect('{')?;
        Body::new(self, &mut f).parse()?;
        match self.func_index.get(&name) {
            Some(&i) => {
                if !self.funcs[i].code.is_empty() {
                    return self.err(format!("`{name}` defined twice"));
                }
                f.noreturn |= self.funcs[i].noreturn;
                self.funcs[i] = f;
            }
            None => {
                self.func_index.insert(name, self.funcs.len());
                self.funcs.push(f);
            }
        }
        Ok(())
    }
}

/// The registers one `{ }` scope declares: plain names, and `%r<N>` ranges by prefix.
#[derive(Default)]
struct Scope<'a> {
    names: HashMap<&'a str, (Reg, Ty)>,
    ranges: HashMap<&'a str, (Reg, u64, Ty)>,
}

impl Scope<'_> {
    fn get(&self, name: &str) -> Option<(Reg, Ty)> {
        if let Some(&r) = self.names.get(name) {
            return Some(r);
        }
        let prefix = name.trim_end_matches(|c: char| c.is_ascii_digit());
        let digits = &name[prefix.len()..];
        if digits.is_empty() || (digits.len() > 1 && digits.starts_with('0')) {
            return None;
        }
        let &(base, count, ty) = self.ranges.get(prefix)?;
        let i: u64 = digits.parse().ok()?;
        (i < count).then(|| (base + i as Reg, ty))
    }
}

/// A function body being parsed.
struct Body<'p, 'a, 'f> {
    p: &'p mut Parser<'a, 'f>,
    f: &'p mut Function,
    scopes: Vec<Scope<'a>>,
    labels: HashMap<&'a str, u32>,
    /// Branches to patch: instruction index, label, line.
    fixups: Vec<(usize, &'a str, u32)>,
}

impl<'p, 'a, 'f> Body<'p, 'a, 'f> {
    fn new(p: &'p mut Parser<'a, 'f>, f: &'p mut Function) -> Self {
        Self {
            p,
            f,
            scopes: vec![Scope::default()],
            labels: HashMap::new(),
            fixups: Vec::new(),
        }
    }

    fn err<T>(&self, msg: impl Into<String>) -> Result<T> {
        self.p.err(msg)
    }

    fn parse(mut self) -> Result<()> {
        let mut label_at = vec![0u32];
        loop {
            let Some(tok) = self.p.peek() else {
                return self.err(format!("`{}`: no closing `}}`", self.f.name));
            };
            match tok {
                Tok::Punct('{') => {
                    self.p.pos += 1;
                    self.scopes.push(Scope::default());
                }
                Tok::Punct('}') => {
                    self.p.pos += 1;
                    self.scopes.pop();
                    if self.scopes.is_empty() {
                        break;
                    }
                }
                Tok::Ident(".reg") => {
                    self.p.pos += 1;
                    self.reg_decl()?;
                }
                Tok::Ident(".param") => {
                    // A call's argument (`.param .b64 param0;` in a callseq block):
                    // a 64-bit register here, written by `st.param`.
                    self.p.pos += 1;
                    let ty = self.p.ident()?;
                    if ty != ".b64" {
                        return self.err(format!("unsupported call parameter type `{ty}`"));
                    }
                    let name = self.p.ident()?;
                    self.p.expect(';')?;
                    self.declare(name, Ty::B64)?;
                }
                Tok::Ident(d) if d.starts_with('.') => {
                    return self.err(format!("unsupported directive `{d}` in a function body"));
                }
                Tok::Ident(name)
                    if self.p.toks.get(self.p.pos + 1).map(|t| t.tok) == Some(Tok::Punct(':')) =>
                {
                    self.p.pos += 2;
                    let at = self.f.code.len() as u32;
                    if self.labels.insert(name, at).is_some() {
                        return self.err(format!("label `{name}` defined twice"));
                    }
                    label_at.push(at);
                }
                _ => {
                    let before = self.f.code.len();
                    self.instruction()?;
                    if matches!(
                        self.f.code.get(before).map(|i| &i.op),
                        Some(Op::Bra(_) | Op::Exit | Op::Ret | Op::Trap | Op::Call { .. })
                    ) {
                        label_at.push(self.f.code.len() as u32);
                    }
                }
            }
        }
        for (at, label, line) in std::mem::take(&mut self.fixups) {
            let Some(&t) = self.labels.get(label) else {
                return Err(Error::parse(
                    self.p.file,
                    line,
                    format!("branch to unknown label `{label}`"),
                ));
            };
            self.f.code[at].op = Op::Bra(t);
        }
        let n = self.f.code.len() as u32;
        label_at.retain(|&b| b < n);
        label_at.sort_unstable();
        label_at.dedup();
        self.f.blocks = label_at;
        Ok(())
    }

    fn declare(&mut self, name: &'a str, ty: Ty) -> Result<Reg> {
        let r = self.f.nregs;
        self.f.nregs += 1;
        let scope = self.scopes.last_mut().expect("inside a body");
        if scope.get(name).is_some() || scope.names.insert(name, (r, ty)).is_some() {
            return self.err(format!("register `{name}` declared twice"));
        }
        Ok(r)
    }

    /// `.reg .TYPE %r<N>;` or `.reg .TYPE name;` (after `.reg`).
    fn reg_decl(&mut self) -> Result<()> {
        let d = self.p.ident()?;
        let ty = match d {
            ".pred" => Ty::Pred,
            ".b16" | ".u16" | ".s16" | ".f16" => Ty::B16,
            ".b32" | ".u32" | ".s32" | ".f32" => Ty::B32,
            ".b64" | ".u64" | ".s64" | ".f64" => Ty::B64,
            _ => return self.err(format!("unsupported register type `{d}`")),
        };
        loop {
            let name = self.p.ident()?;
            if self.p.eat('<') {
                let n = self.p.int()?;
                self.p.expect('>')?;
                if n > 1 << 16 {
                    return self.err(format!("{n} registers"));
                }
                let base = self.f.nregs;
                self.f.nregs += n as u32;
                let scope = self.scopes.last_mut().expect("inside a body");
                if scope.ranges.insert(name, (base, n, ty)).is_some() {
                    return self.err(format!("registers `{name}<>` declared twice"));
                }
            } else {
                self.declare(name, ty)?;
            }
            if !self.p.eat(',') {
                break;
            }
        }
        self.p.expect(';')
    }

    fn lookup(&self, name: &str) -> Option<(Reg, Ty)> {
        self.scopes.iter().rev().find_map(|s| s.get(name))
    }

    fn reg(&self, o: &Opnd<'a>) -> Result<Reg> {
        match o {
            Opnd::Name(n) => match self.lookup(n) {
                Some((r, _)) => Ok(r),
                None => self.err(format!("unknown register `{n}`")),
            },
            _ => self.err(format!("expected a register, found {o:?}")),
        }
    }

    /// Register `o`, which the instruction writes (or, for `verb` "reads", reads) as
    /// `ty`: an error when it was declared of another width.
    fn reg_as(&self, o: &Opnd<'a>, ty: Ty, verb: &str) -> Result<Reg> {
        let r = self.reg(o)?;
        if let Opnd::Name(n) = o
            && let Some((_, rty)) = self.lookup(n)
            && rty.bits() != ty.bits()
        {
            return self.err(format!(
                "register `{n}` ({} bits) where the instruction {verb} {} bits",
                rty.bits(),
                ty.bits()
            ));
        }
        Ok(r)
    }

    /// A destination register of type `ty` (its declared width checked).
    fn dst(&self, o: &Opnd<'a>, ty: Ty) -> Result<Reg> {
        self.reg_as(o, ty, "writes")
    }

    /// A load's destination register: of `ty`'s width or wider (the ISA lets a load
    /// write a wider register, zero-extending: `ld.param.b32 %rd6`), never a predicate.
    fn ld_dst(&self, o: &Opnd<'a>, ty: Ty) -> Result<Reg> {
        if let Opnd::Name(n) = o
            && let Some((_, rty)) = self.lookup(n)
            && (rty.bits() < ty.bits() || rty == Ty::Pred)
        {
            return self.err(format!(
                "register `{n}` ({} bits) where the load writes {} bits",
                rty.bits(),
                ty.bits()
            ));
        }
        self.reg(o)
    }

    /// A destination of type `ty` that may be the sink `_`.
    fn dst_or_sink(&self, o: &Opnd<'a>, ty: Ty) -> Result<Option<Reg>> {
        match o {
            Opnd::Name("_") => Ok(None),
            _ => self.dst(o, ty).map(Some),
        }
    }

    fn src(&self, o: &Opnd<'a>, ty: Ty) -> Result<Src> {
        let bits = match *o {
            Opnd::Name(n) => {
                if let Some((r, rty)) = self.lookup(n) {
                    if rty.bits() != ty.bits() {
                        return self.err(format!(
                            "register `{n}` ({} bits) where the instruction reads {} bits",
                            rty.bits(),
                            ty.bits()
                        ));
                    }
                    return Ok(Src::R(r));
                }
                if self.p.shared_syms.contains(&n) {
                    // The dynamic shared array starts the CTA's shared window.
                    return Ok(Src::I(0));
                }
                if let Some(&g) = self.p.global_index.get(n) {
                    return Ok(Src::I(self.p.globals[g].addr()));
                }
                return self.err(format!("unknown register or symbol `{n}`"));
            }
            Opnd::Int(v) => match ty {
                Ty::F32 => (v as f32).to_bits() as u64,
                _ => (v as u64) & ty.mask(),
            },
            Opnd::F32(b) => match ty {
                Ty::F32 | Ty::B32 => b as u64,
                _ => return self.err("an `f32` literal for a non-32-bit operand"),
            },
            Opnd::F64(b) => match ty {
                Ty::F32 => (f64::from_bits(b) as f32).to_bits() as u64,
                Ty::B64 => b,
                _ => return self.err("an `f64` literal for a non-float operand"),
            },
            _ => return self.err(format!("expected a register or immediate, found {o:?}")),
        };
        Ok(Src::I(bits))
    }

    fn addr(&self, o: &Opnd<'a>) -> Result<(Addr, Option<&'a str>)> {
        let Opnd::Addr(base, off) = *o else {
            return self.err(format!("expected an address, found {o:?}"));
        };
        if let Some((r, _)) = self.lookup(base) {
            return Ok((Addr { base: Some(r), off }, None));
        }
        Ok((Addr { base: None, off }, Some(base)))
    }

    fn operand(&mut self) -> Result<Opnd<'a>> {
        let p = &mut *self.p;
        match p.next()? {
            Tok::Ident(n) => Ok(Opnd::Name(n)),
            Tok::Int(v) => Ok(Opnd::Int(v as i128)),
            Tok::F32(b) => Ok(Opnd::F32(b)),
            Tok::F64(b) => Ok(Opnd::F64(b)),
            Tok::Punct('-') => match p.next()? {
                Tok::Int(v) => Ok(Opnd::Int(-(v as i128))),
                t => p.err(format!("`-` before {t:?}")),
            },
            Tok::Punct('[') => {
                let base = p.ident()?;
                let mut off = 0i64;
                if p.eat('+') {
                    let neg = p.eat('-');
                    let v = p.int()? as i64;
                    off = if neg { -v } else { v };
                } else if p.eat('-') {
                    off = -(p.int()? as i64);
                }
                p.expect(']')?;
                Ok(Opnd::Addr(base, off))
            }
            Tok::Punct('{') => {
                let mut v = Vec::new();
                loop {
                    v.push(self.operand()?);
                    if self.p.eat('}') {
                        break;
                    }
                    self.p.expect(',')?;
                }
                Ok(Opnd::Vec(v))
            }
            Tok::Punct('(') => {
                let mut v = Vec::new();
                if !p.eat(')') {
                    loop {
                        v.push(p.ident()?);
                        if p.eat(')') {
                            break;
                        }
                        p.expect(',')?;
                    }
                }
                Ok(Opnd::List(v))
            }
            t => p.err(format!("unexpected {t:?} in an operand")),
        }
    }

    fn instruction(&mut self) -> Result<()> {
        let line = self.p.line();
        let mut guard = None;
        if self.p.eat('@') {
            let neg = self.p.eat('!');
            let name = self.p.ident()?;
            match self.lookup(name) {
                Some((r, Ty::Pred)) => guard = Some((r, neg)),
                _ => return self.err(format!("guard `{name}` is not a predicate register")),
            }
        }
        let opc = self.p.ident()?;
        let mut ops = Vec::new();
        if !self.p.eat(';') {
            loop {
                ops.push(self.operand()?);
                if self.p.eat(';') {
                    break;
                }
                self.p.expect(',')?;
            }
        }
        let op = self.decode(opc, &ops, line)?;
        self.f.code.push(Inst { guard, op, line });
        Ok(())
    }

    fn arity(&self, opc: &str, ops: &[Opnd<'a>], n: usize) -> Result<()> {
        if ops.len() != n {
            return self.err(format!("`{opc}` takes {n} operands, found {}", ops.len()));
        }
        Ok(())
    }

    /// A vector of `N` destination registers of type `ty`.
    fn vec_dsts<const N: usize>(&self, o: &Opnd<'a>, ty: Ty) -> Result<[Reg; N]> {
        match o {
            Opnd::Vec(v) if v.len() == N => {
                let mut out = [0; N];
                for (d, e) in out.iter_mut().zip(v) {
                    *d = self.dst(e, ty)?;
                }
                Ok(out)
            }
            _ => self.err(format!("expected a vector of {N} registers, found {o:?}")),
        }
    }

    fn vec_srcs<const N: usize>(&self, o: &Opnd<'a>, ty: Ty) -> Result<[Src; N]> {
        match o {
            Opnd::Vec(v) if v.len() == N => {
                let mut out = [Src::I(0); N];
                for (d, e) in out.iter_mut().zip(v) {
                    *d = self.src(e, ty)?;
                }
                Ok(out)
            }
            _ => self.err(format!("expected a vector of {N} operands, found {o:?}")),
        }
    }

    fn decode(&mut self, opc: &'a str, ops: &[Opnd<'a>], line: u32) -> Result<Op> {
        use BinOp::*;
        // The type the instruction writes: its destination's declared width must match.
        let dty = dst_ty(opc);
        let dreg = |s: &Self| -> Result<Reg> {
            match dty {
                Some(t) => s.dst(&ops[0], t),
                None => s.err(format!("no destination type in `{opc}`")),
            }
        };
        let bin = |s: &Self, op: BinOp, ty: Ty, bty: Ty| -> Result<Op> {
            s.arity(opc, ops, 3)?;
            Ok(Op::Bin {
                op,
                d: dreg(s)?,
                a: s.src(&ops[1], ty)?,
                b: s.src(&ops[2], bty)?,
            })
        };
        let un = |s: &Self, op: UnOp, ty: Ty, mask: u64| -> Result<Op> {
            s.arity(opc, ops, 2)?;
            Ok(Op::Un {
                op,
                d: dreg(s)?,
                a: s.src(&ops[1], ty)?,
                mask,
            })
        };
        let tern = |s: &Self, op: TernOp, ty: Ty| -> Result<Op> {
            s.arity(opc, ops, 4)?;
            Ok(Op::Tern {
                op,
                d: dreg(s)?,
                a: s.src(&ops[1], ty)?,
                b: s.src(&ops[2], ty)?,
                c: s.src(&ops[3], ty)?,
            })
        };
        let (b16, b32, b64, f32t, pred) = (Ty::B16, Ty::B32, Ty::B64, Ty::F32, Ty::Pred);
        let op = match opc {
            "add.s16" | "add.u16" => bin(self, Add16, b16, b16)?,
            "add.s32" | "add.u32" => bin(self, Add32, b32, b32)?,
            "add.s64" | "add.u64" => bin(self, Add64, b64, b64)?,
            "sub.s16" | "sub.u16" => bin(self, Sub16, b16, b16)?,
            "sub.s32" | "sub.u32" => bin(self, Sub32, b32, b32)?,
            "sub.s64" | "sub.u64" => bin(self, Sub64, b64, b64)?,
            "mul.lo.s16" | "mul.lo.u16" => bin(self, MulLo16, b16, b16)?,
            "mul.lo.s32" | "mul.lo.u32" => bin(self, MulLo32, b32, b32)?,
            "mul.lo.s64" | "mul.lo.u64" => bin(self, MulLo64, b64, b64)?,
            "mul.wide.u16" => bin(self, MulWideU16, b16, b16)?,
            "mul.wide.u32" => bin(self, MulWideU32, b32, b32)?,
            "and.b16" => bin(self, And16, b16, b16)?,
            "and.b32" => bin(self, And32, b32, b32)?,
            "and.b64" => bin(self, And64, b64, b64)?,
            "or.b16" => bin(self, Or16, b16, b16)?,
            "or.b32" => bin(self, Or32, b32, b32)?,
            "or.b64" => bin(self, Or64, b64, b64)?,
            "xor.b16" => bin(self, Xor16, b16, b16)?,
            "xor.b32" => bin(self, Xor32, b32, b32)?,
            "and.pred" => bin(self, AndPred, pred, pred)?,
            "or.pred" => bin(self, OrPred, pred, pred)?,
            "shl.b16" => bin(self, Shl16, b16, b32)?,
            "shl.b32" => bin(self, Shl32, b32, b32)?,
            "shl.b64" => bin(self, Shl64, b64, b32)?,
            "shr.u16" => bin(self, ShrU16, b16, b32)?,
            "shr.u32" => bin(self, ShrU32, b32, b32)?,
            "shr.u64" => bin(self, ShrU64, b64, b32)?,
            "min.u32" => bin(self, MinU32, b32, b32)?,
            "max.u32" => bin(self, MaxU32, b32, b32)?,
            "div.u16" => bin(self, DivU16, b16, b16)?,
            "div.u32" => bin(self, DivU32, b32, b32)?,
            "div.u64" => bin(self, DivU64, b64, b64)?,
            "rem.u32" => bin(self, RemU32, b32, b32)?,
            "rem.u64" => bin(self, RemU64, b64, b64)?,
            "add.rn.f32" => bin(self, AddF32, f32t, f32t)?,
            "sub.rn.f32" => bin(self, SubF32, f32t, f32t)?,
            "mul.rn.f32" => bin(self, MulF32, f32t, f32t)?,
            "mul.rn.f16x2" => bin(self, MulF16x2, b32, b32)?,
            "div.rn.f32" => bin(self, DivF32, f32t, f32t)?,
            "cvt.rn.satfinite.e4m3x2.f32" => bin(self, E4m3x2FromF32, f32t, f32t)?,
            "cvt.rn.satfinite.e5m2x2.f32" => bin(self, E5m2x2FromF32, f32t, f32t)?,
            "not.b16" => un(self, UnOp::Not16, b16, b16.mask())?,
            "not.b32" => un(self, UnOp::Not32, b32, b32.mask())?,
            "not.pred" => un(self, UnOp::NotPred, pred, 1)?,
            "neg.s32" => un(self, UnOp::Neg32, b32, b32.mask())?,
            "popc.b32" => un(self, UnOp::Popc32, b32, b32.mask())?,
            "clz.b32" => un(self, UnOp::Clz32, b32, b32.mask())?,
            "cvt.u32.u16" => un(self, UnOp::Mov, b16, b16.mask())?,
            "cvt.u16.u32" => un(self, UnOp::Trunc16, b32, b16.mask())?,
            "cvt.u16.u64" => un(self, UnOp::Trunc16, b64, b16.mask())?,
            "cvt.u64.u32" => un(self, UnOp::Mov, b32, b32.mask())?,
            "cvt.u32.u64" => un(self, UnOp::Trunc32, b64, b32.mask())?,
            "cvt.rn.f32.u32" => un(self, UnOp::F32FromU32, b32, b32.mask())?,
            "cvt.f32.f16" => un(self, UnOp::F32FromF16, b16, b32.mask())?,
            "cvt.rn.f16.f32" => un(self, UnOp::F16FromF32, f32t, b16.mask())?,
            "cvt.rn.bf16.f32" => un(self, UnOp::Bf16FromF32, f32t, b16.mask())?,
            "cvt.rn.f16x2.e4m3x2" => un(self, UnOp::F16x2FromE4m3x2, b16, b32.mask())?,
            "cvt.rn.f16x2.e5m2x2" => un(self, UnOp::F16x2FromE5m2x2, b16, b32.mask())?,
            "rcp.rn.f32" => un(self, UnOp::RcpF32, f32t, b32.mask())?,
            "ex2.approx.ftz.f32" => un(self, UnOp::Ex2ApproxFtz, f32t, b32.mask())?,
            "tanh.approx.f32" => un(self, UnOp::TanhApprox, f32t, b32.mask())?,
            "lg2.approx.ftz.f32" => un(self, UnOp::Lg2ApproxFtz, f32t, b32.mask())?,
            "cvta.to.global.u64" | "cvta.global.u64" => un(self, UnOp::Mov, b64, b64.mask())?,
            "mad.lo.s32" | "mad.lo.u32" => tern(self, TernOp::MadLo32, b32)?,
            "mad.lo.s64" | "mad.lo.u64" => tern(self, TernOp::MadLo64, b64)?,
            "fma.rn.f32" => tern(self, TernOp::FmaF32, f32t)?,
            "bfe.u32" => tern(self, TernOp::BfeU32, b32)?,
            "shf.l.wrap.b32" => tern(self, TernOp::ShfLWrap32, b32)?,
            "prmt.b32" => tern(self, TernOp::PrmtB32, b32)?,
            _ if opc.starts_with("mov.") => self.mov(opc, ops)?,
            _ if opc.starts_with("setp.") => self.setp(opc, ops)?,
            _ if opc.starts_with("selp.") => {
                self.arity(opc, ops, 4)?;
                let ty = match &opc[5..] {
                    "b16" | "u16" | "s16" => b16,
                    "b32" | "u32" | "s32" => b32,
                    "b64" | "u64" | "s64" => b64,
                    "f32" => f32t,
                    _ => return self.err(format!("unsupported `{opc}`")),
                };
                Op::Selp {
                    d: self.dst(&ops[0], ty)?,
                    a: self.src(&ops[1], ty)?,
                    b: self.src(&ops[2], ty)?,
                    p: self.reg_as(&ops[3], pred, "reads")?,
                }
            }
            _ if opc.starts_with("ld.") || opc.starts_with("st.") => self.memory(opc, ops)?,
            "cp.async.cg.shared.global" => {
                if ops.len() != 4 {
                    self.arity(opc, ops, 3)?;
                }
                let bytes = match ops[2] {
                    Opnd::Int(16) => 16,
                    _ => return self.err("`cp.async.cg` copies 16 bytes"),
                };
                let (dst, ds) = self.addr(&ops[0])?;
                let (src, ss) = self.addr(&ops[1])?;
                if ds.is_some() || ss.is_some() {
                    return self.err("`cp.async` operands must be registers");
                }
                let src_size = match ops.get(3) {
                    Some(o) => Some(self.src(o, Ty::B32)?),
                    None => None,
                };
                Op::CpAsync {
                    dst,
                    src,
                    bytes,
                    src_size,
                }
            }
            "cp.async.commit_group" => {
                self.arity(opc, ops, 0)?;
                Op::CpCommit
            }
            "cp.async.wait_group" => {
                self.arity(opc, ops, 1)?;
                match ops[0] {
                    Opnd::Int(n) if (0..=8).contains(&n) => Op::CpWait(n as u32),
                    _ => return self.err("`cp.async.wait_group` takes a constant 0..=8"),
                }
            }
            "bar.sync" => {
                self.arity(opc, ops, 1)?;
                if ops[0] != Opnd::Int(0) {
                    return self.err("only `bar.sync 0` is supported");
                }
                Op::Bar
            }
            "shfl.sync.bfly.b32" => {
                self.arity(opc, ops, 5)?;
                Op::Shfl {
                    d: self.dst(&ops[0], b32)?,
                    a: self.src(&ops[1], b32)?,
                    lane: self.src(&ops[2], b32)?,
                    clamp: self.src(&ops[3], b32)?,
                    mask: self.src(&ops[4], b32)?,
                }
            }
            _ if opc.starts_with("ldmatrix.sync.aligned.m8n8.") => {
                self.arity(opc, ops, 2)?;
                let (n, trans) = match &opc["ldmatrix.sync.aligned.m8n8.".len()..] {
                    "x1.shared.b16" => (1u8, false),
                    "x2.shared.b16" => (2, false),
                    "x4.shared.b16" => (4, false),
                    "x1.trans.shared.b16" => (1, true),
                    "x2.trans.shared.b16" => (2, true),
                    "x4.trans.shared.b16" => (4, true),
                    _ => return self.err(format!("unsupported `{opc}`")),
                };
                let mut d = [0; 4];
                match &ops[0] {
                    Opnd::Vec(v) if v.len() == n as usize => {
                        for (i, e) in v.iter().enumerate() {
                            d[i] = self.dst(e, b32)?;
                        }
                    }
                    Opnd::Name(_) if n == 1 => d[0] = self.dst(&ops[0], b32)?,
                    o => return self.err(format!("`{opc}` destination {o:?}")),
                }
                let (addr, sym) = self.addr(&ops[1])?;
                if sym.is_some() {
                    return self.err("`ldmatrix` address must be a register");
                }
                Op::Ldmatrix { n, trans, d, addr }
            }
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"
            | "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" => {
                self.arity(opc, ops, 4)?;
                Op::Mma {
                    bf16: opc.contains("bf16"),
                    d: self.vec_dsts::<4>(&ops[0], f32t)?,
                    a: self.vec_srcs::<4>(&ops[1], b32)?,
                    b: self.vec_srcs::<2>(&ops[2], b32)?,
                    c: self.vec_srcs::<4>(&ops[3], f32t)?,
                }
            }
            "bra" | "bra.uni" => {
                self.arity(opc, ops, 1)?;
                let Opnd::Name(label) = ops[0] else {
                    return self.err("`bra` takes a label");
                };
                self.fixups.push((self.f.code.len(), label, line));
                Op::Bra(u32::MAX)
            }
            "exit" => Op::Exit,
            "ret" => Op::Ret,
            "trap" => Op::Trap,
            "call.uni" | "call" => {
                let (Some(Opnd::Name(callee)), rest) = (ops.first(), ops.get(1..).unwrap_or(&[]))
                else {
                    return self.err("`call` without a callee");
                };
                let Some(&fi) = self.p.func_index.get(*callee) else {
                    return self.err(format!("call of undeclared `{callee}`"));
                };
                if !self.p.funcs[fi].noreturn {
                    return self.err(format!(
                        "call of `{callee}`: only calls of `.noreturn` functions are supported"
                    ));
                }
                let arg = match rest {
                    [] => None,
                    [Opnd::List(l)] if l.is_empty() => None,
                    [Opnd::List(l)] if l.len() == 1 => Some(self.src(&Opnd::Name(l[0]), b64)?),
                    _ => return self.err("`call` with a return value or several arguments"),
                };
                Op::Call {
                    func: fi as u32,
                    arg,
                }
            }
            _ => return self.err(format!("unsupported instruction `{opc}`")),
        };
        Ok(op)
    }

    fn mov(&self, opc: &str, ops: &[Opnd<'a>]) -> Result<Op> {
        self.arity(opc, ops, 2)?;
        let ty = match &opc[4..] {
            "b16" | "u16" => Ty::B16,
            "b32" | "u32" | "s32" | "f32" => Ty::B32,
            "b64" | "u64" | "s64" => Ty::B64,
            "pred" => Ty::Pred,
            _ => return self.err(format!("unsupported `{opc}`")),
        };
        let half_ty = match ty {
            Ty::B32 => Ty::B16,
            Ty::B64 => Ty::B32,
            _ => Ty::Pred,
        };
        if let Opnd::Vec(v) = &ops[0] {
            if v.len() != 2 || half_ty == Ty::Pred {
                return self.err(format!("`{opc}` unpacks into two halves"));
            }
            return Ok(Op::Unpack {
                lo: self.dst_or_sink(&v[0], half_ty)?,
                hi: self.dst_or_sink(&v[1], half_ty)?,
                a: self.src(&ops[1], ty)?,
                half: half_ty.bits(),
            });
        }
        let d = self.dst(&ops[0], ty)?;
        if let Opnd::Vec(v) = &ops[1] {
            if v.len() != 2 || half_ty == Ty::Pred {
                return self.err(format!("`{opc}` packs two halves"));
            }
            return Ok(Op::Pack {
                d,
                lo: self.src(&v[0], half_ty)?,
                hi: self.src(&v[1], half_ty)?,
                half: half_ty.bits(),
            });
        }
        if let Opnd::Name(n) = ops[1] {
            let dim = |s: &str| match s {
                "x" => Some(0u8),
                "y" => Some(1),
                "z" => Some(2),
                _ => None,
            };
            let special = n.split_once('.').and_then(|(r, c)| {
                let c = dim(c)?;
                match r {
                    "%tid" => Some(Special::Tid(c)),
                    "%ntid" => Some(Special::Ntid(c)),
                    "%ctaid" => Some(Special::Ctaid(c)),
                    "%nctaid" => Some(Special::Nctaid(c)),
                    _ => None,
                }
            });
            if let Some(s) = special {
                return Ok(Op::Special { d, s });
            }
            if n.starts_with('%') && self.lookup(n).is_none() {
                return self.err(format!("unsupported special register `{n}`"));
            }
        }
        Ok(Op::Un {
            op: UnOp::Mov,
            d,
            a: self.src(&ops[1], ty)?,
            mask: ty.mask(),
        })
    }

    fn setp(&self, opc: &str, ops: &[Opnd<'a>]) -> Result<Op> {
        self.arity(opc, ops, 3)?;
        let mut parts = opc.split('.').skip(1);
        let (Some(c), Some(t), None) = (parts.next(), parts.next(), parts.next()) else {
            return self.err(format!("unsupported `{opc}`"));
        };
        let (ty, sty) = match t {
            "b16" | "u16" => (CmpTy::U16, Ty::B16),
            "s16" => (CmpTy::S16, Ty::B16),
            "b32" | "u32" => (CmpTy::U32, Ty::B32),
            "s32" => (CmpTy::S32, Ty::B32),
            "b64" | "u64" => (CmpTy::U64, Ty::B64),
            "s64" => (CmpTy::S64, Ty::B64),
            "f32" => (CmpTy::F32, Ty::F32),
            _ => return self.err(format!("unsupported `{opc}`")),
        };
        let cmp = match c {
            "eq" => CmpOp::Eq,
            "ne" => CmpOp::Ne,
            "lt" => CmpOp::Lt,
            "le" => CmpOp::Le,
            "gt" => CmpOp::Gt,
            "ge" => CmpOp::Ge,
            "equ" | "neu" | "ltu" | "leu" | "gtu" | "geu" if ty == CmpTy::F32 => match c {
                "equ" => CmpOp::Equ,
                "neu" => CmpOp::Neu,
                "ltu" => CmpOp::Ltu,
                "leu" => CmpOp::Leu,
                "gtu" => CmpOp::Gtu,
                _ => CmpOp::Geu,
            },
            _ => return self.err(format!("unsupported `{opc}`")),
        };
        if matches!(t, "b16" | "b32" | "b64") && !matches!(cmp, CmpOp::Eq | CmpOp::Ne) {
            return self.err(format!("`{opc}`: bit types compare only eq/ne"));
        }
        Ok(Op::Setp {
            ty,
            cmp,
            d: self.dst(&ops[0], Ty::Pred)?,
            a: self.src(&ops[1], sty)?,
            b: self.src(&ops[2], sty)?,
        })
    }

    fn memory(&self, opc: &str, ops: &[Opnd<'a>]) -> Result<Op> {
        self.arity(opc, ops, 2)?;
        let is_ld = opc.starts_with("ld.");
        let mut parts: Vec<&str> = opc.split('.').skip(1).collect();
        let mut space = Space::Generic;
        let mut nc = false;
        let mut n = 1u8;
        if let Some(&s) = parts.first() {
            let sp = match s {
                "param" => Some(Space::Param),
                "global" => Some(Space::Global),
                "shared" => Some(Space::Shared),
                _ => None,
            };
            if let Some(sp) = sp {
                space = sp;
                parts.remove(0);
            }
        }
        if parts.first() == Some(&"nc") && is_ld && space == Space::Global {
            nc = true;
            parts.remove(0);
        }
        if parts.first() == Some(&"v4") {
            n = 4;
            parts.remove(0);
        }
        let bytes = match parts.as_slice() {
            ["b16" | "u16"] => 2u8,
            ["b32" | "u32" | "f32"] => 4,
            ["b64" | "u64"] => 8,
            _ => return self.err(format!("unsupported `{opc}`")),
        };
        if n == 4 && bytes != 4 {
            return self.err(format!(
                "unsupported `{opc}`: only `.v4` of 32-bit elements"
            ));
        }
        let ty = match bytes {
            2 => Ty::B16,
            4 => Ty::B32,
            _ => Ty::B64,
        };
        let (addr_op, val) = if is_ld {
            (&ops[1], &ops[0])
        } else {
            (&ops[0], &ops[1])
        };
        if space == Space::Param {
            let Opnd::Addr(sym, off) = *addr_op else {
                return self.err(format!("`{opc}` needs an address"));
            };
            if let Some(pd) = self.f.params.iter().find(|p| p.name == sym) {
                if !is_ld {
                    return self.err("stores to the entry's parameters");
                }
                let addr = Addr {
                    base: None,
                    off: off + pd.offset as i64,
                };
                let mut d = [0; 4];
                if n == 4 {
                    d = self.vec_dsts::<4>(val, ty)?;
                } else {
                    d[0] = self.ld_dst(val, ty)?;
                }
                return Ok(Op::Ld {
                    space,
                    bytes,
                    n,
                    nc,
                    d,
                    addr,
                });
            }
            // `st.param.b64 [param0], %rd`: a call's argument, a register here.
            if let (false, 0, 8, 1, Some((r, Ty::B64))) = (is_ld, off, bytes, n, self.lookup(sym)) {
                return Ok(Op::Un {
                    op: UnOp::Mov,
                    d: r,
                    a: self.src(val, ty)?,
                    mask: u64::MAX,
                });
            }
            return self.err(format!("`{opc}`: unknown parameter `{sym}`"));
        }
        let (addr, sym) = self.addr(addr_op)?;
        if let Some(sym) = sym {
            return self.err(format!(
                "`{opc}` at symbol `{sym}`: only registers address this space"
            ));
        }
        if is_ld {
            let mut d = [0; 4];
            if n == 4 {
                d = self.vec_dsts::<4>(val, ty)?;
            } else {
                d[0] = self.ld_dst(val, ty)?;
            }
            Ok(Op::Ld {
                space,
                bytes,
                n,
                nc,
                d,
                addr,
            })
        } else {
            let mut v = [Src::I(0); 4];
            if n == 4 {
                v = self.vec_srcs::<4>(val, ty)?;
            } else {
                v[0] = self.src(val, ty)?;
            }
            Ok(Op::St {
                space,
                bytes,
                n,
                v,
                addr,
            })
        }
    }
}

//! A small reader for the kernel's BTF (`/sys/kernel/btf/vmlinux`): just enough to find struct member
//! offsets (through anonymous unions and nested structs), enum values and whether a BTF tracepoint exists, so the eBPF
//! program gets the running kernel's layout instead of offsets compiled for one build.

use std::collections::HashMap;
use std::path::Path;

/// Where the running kernel publishes its BTF.
pub const VMLINUX_BTF: &str = "/sys/kernel/btf/vmlinux";

const BTF_MAGIC: u16 = 0xeb9f;
const KIND_INT: u32 = 1;
const KIND_ARRAY: u32 = 3;
const KIND_STRUCT: u32 = 4;
const KIND_UNION: u32 = 5;
const KIND_ENUM: u32 = 6;
const KIND_TYPEDEF: u32 = 8;
const KIND_VOLATILE: u32 = 9;
const KIND_CONST: u32 = 10;
const KIND_RESTRICT: u32 = 11;
const KIND_FUNC_PROTO: u32 = 13;
const KIND_VAR: u32 = 14;
const KIND_DATASEC: u32 = 15;
const KIND_DECL_TAG: u32 = 17;
const KIND_TYPE_TAG: u32 = 18;
const KIND_ENUM64: u32 = 19;

/// Why BTF could not be read or a member not found.
#[derive(Debug, thiserror::Error)]
pub enum BtfError {
    #[error("reading {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("not BTF data: {0}")]
    Malformed(&'static str),
    #[error("struct {0} not in the kernel's BTF")]
    NoStruct(String),
    #[error("member {member} not in struct {strukt}")]
    NoMember { strukt: String, member: String },
}

/// A struct or union member; for an enum, one enumerator (its value in `type_id`).
#[derive(Debug, Clone)]
struct Member {
    name: u32,
    type_id: u32,
    bit_offset: u32,
}

#[derive(Debug, Clone)]
struct Type {
    kind: u32,
    name: u32,
    /// size for structs/unions, referenced type for typedef/const/volatile/pointer.
    size_or_type: u32,
    members: Vec<Member>,
}

/// Parsed kernel BTF: types and names.
pub struct Btf {
    strings: Vec<u8>,
    /// Index 0 is `void`.
    types: Vec<Type>,
    by_name: HashMap<String, Vec<u32>>,
}

impl Btf {
    /// Reads the running kernel's BTF.
    pub fn from_sys_fs() -> Result<Self, BtfError> {
        Self::from_file(Path::new(VMLINUX_BTF))
    }

    /// Reads BTF from a file (raw `.BTF` data, as in `/sys/kernel/btf/vmlinux`).
    pub fn from_file(path: &Path) -> Result<Self, BtfError> {
        let data = std::fs::read(path).map_err(|source| BtfError::Read {
            path: path.display().to_string(),
            source,
        })?;
        Self::parse(&data)
    }

    /// Parses raw BTF data (little-endian hosts only, which is every host this agent runs on).
    pub fn parse(data: &[u8]) -> Result<Self, BtfError> {
        let u16_at = |o: usize| data.get(o..o + 2).map(|b| u16::from_le_bytes([b[0], b[1]]));
        let u32_at = |o: usize| {
            data.get(o..o + 4)
                .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        };
        if u16_at(0) != Some(BTF_MAGIC) {
            return Err(BtfError::Malformed("bad magic"));
        }
        let field = |o| u32_at(o).ok_or(BtfError::Malformed("short header"));
        let hdr_len = field(4)? as usize;
        let type_off = field(8)? as usize;
        let type_len = field(12)? as usize;
        let str_off = field(16)? as usize;
        let str_len = field(20)? as usize;
        let strings = data
            .get(hdr_len + str_off..hdr_len + str_off + str_len)
            .ok_or(BtfError::Malformed("string section out of bounds"))?
            .to_vec();
        let start = hdr_len + type_off;
        let end = start + type_len;
        if data.len() < end {
            return Err(BtfError::Malformed("type section out of bounds"));
        }
        let mut types = vec![Type {
            kind: 0,
            name: 0,
            size_or_type: 0,
            members: Vec::new(),
        }];
        let mut at = start;
        let short = BtfError::Malformed("truncated type");
        while at + 12 <= end {
            let name = u32_at(at).ok_or(BtfError::Malformed("truncated type"))?;
            let info = u32_at(at + 4).ok_or(BtfError::Malformed("truncated type"))?;
            let size_or_type = u32_at(at + 8).ok_or(BtfError::Malformed("truncated type"))?;
            at += 12;
            let vlen = (info & 0xffff) as usize;
            let kind = (info >> 24) & 0x1f;
            let kind_flag = info >> 31 == 1;
            let mut members = Vec::new();
            match kind {
                KIND_INT | KIND_VAR | KIND_DECL_TAG => at += 4,
                KIND_ARRAY => at += 12,
                KIND_STRUCT | KIND_UNION => {
                    for i in 0..vlen {
                        let m = at + i * 12;
                        let (Some(name), Some(type_id), Some(off)) =
                            (u32_at(m), u32_at(m + 4), u32_at(m + 8))
                        else {
                            return Err(short);
                        };
                        let bit_offset = if kind_flag { off & 0x00ff_ffff } else { off };
                        members.push(Member {
                            name,
                            type_id,
                            bit_offset,
                        });
                    }
                    at += vlen * 12;
                }
                KIND_ENUM => {
                    for i in 0..vlen {
                        let e = at + i * 8;
                        let (Some(name), Some(value)) = (u32_at(e), u32_at(e + 4)) else {
                            return Err(short);
                        };
                        members.push(Member {
                            name,
                            type_id: value,
                            bit_offset: 0,
                        });
                    }
                    at += vlen * 8;
                }
                KIND_FUNC_PROTO => at += vlen * 8,
                KIND_DATASEC | KIND_ENUM64 => at += vlen * 12,
                _ => {}
            }
            types.push(Type {
                kind,
                name,
                size_or_type,
                members,
            });
        }
        let mut btf = Btf {
            strings,
            types,
            by_name: HashMap::new(),
        };
        for (id, t) in btf.types.iter().enumerate().skip(1) {
            if t.name != 0 {
                let name = btf.name(t.name).to_string();
                btf.by_name.entry(name).or_default().push(id as u32);
            }
        }
        Ok(btf)
    }

    fn name(&self, off: u32) -> &str {
        let rest = self.strings.get(off as usize..).unwrap_or_default();
        let end = rest.iter().position(|&b| b == 0).unwrap_or(rest.len());
        std::str::from_utf8(&rest[..end]).unwrap_or("")
    }

    /// Whether the kernel has the BTF tracepoint `name` (a `btf_trace_<name>` typedef).
    pub fn has_tracepoint(&self, name: &str) -> bool {
        self.by_name.contains_key(&format!("btf_trace_{name}"))
    }

    fn struct_id(&self, name: &str) -> Option<u32> {
        self.by_name.get(name)?.iter().copied().find(|&id| {
            let t = &self.types[id as usize];
            t.kind == KIND_STRUCT && t.size_or_type > 0
        })
    }

    /// Strips typedefs and qualifiers.
    fn resolve(&self, mut id: u32) -> u32 {
        for _ in 0..32 {
            match self.types.get(id as usize) {
                Some(t)
                    if matches!(
                        t.kind,
                        KIND_TYPEDEF | KIND_VOLATILE | KIND_CONST | KIND_RESTRICT | KIND_TYPE_TAG
                    ) =>
                {
                    id = t.size_or_type
                }
                _ => break,
            }
        }
        id
    }

    /// Finds `name` among the members of `id`, descending into anonymous structs and unions; bit offset and
    /// the member's type.
    fn find_member(&self, id: u32, name: &str) -> Option<(u32, u32)> {
        let t = self.types.get(self.resolve(id) as usize)?;
        if t.kind != KIND_STRUCT && t.kind != KIND_UNION {
            return None;
        }
        for m in &t.members {
            if m.name == 0 {
                if let Some((off, ty)) = self.find_member(m.type_id, name) {
                    return Some((m.bit_offset + off, ty));
                }
            } else if self.name(m.name) == name {
                return Some((m.bit_offset, m.type_id));
            }
        }
        None
    }

    /// Value of `variant` in `enum name` (32-bit enums).
    pub fn enum_value(&self, name: &str, variant: &str) -> Result<u32, BtfError> {
        let id = self
            .by_name
            .get(name)
            .and_then(|ids| {
                ids.iter()
                    .copied()
                    .find(|&id| self.types[id as usize].kind == KIND_ENUM)
            })
            .ok_or_else(|| BtfError::NoStruct(format!("enum {name}")))?;
        self.types[id as usize]
            .members
            .iter()
            .find(|m| self.name(m.name) == variant)
            .map(|m| m.type_id)
            .ok_or_else(|| BtfError::NoMember {
                strukt: format!("enum {name}"),
                member: variant.to_string(),
            })
    }

    /// Byte offset of `path` (members separated by dots, e.g. `__sk_common.skc_num`) in `struct strukt`.
    pub fn member_offset(&self, strukt: &str, path: &str) -> Result<u32, BtfError> {
        let mut id = self
            .struct_id(strukt)
            .ok_or_else(|| BtfError::NoStruct(strukt.to_string()))?;
        let mut bits = 0;
        for part in path.split('.') {
            let (off, ty) = self
                .find_member(id, part)
                .ok_or_else(|| BtfError::NoMember {
                    strukt: strukt.to_string(),
                    member: path.to_string(),
                })?;
            bits += off;
            id = ty;
        }
        Ok(bits / 8)
    }
}

#[cfg(test)]
mod tests;

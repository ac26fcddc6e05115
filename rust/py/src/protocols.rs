//! Protocol descriptors between Python and the data plane: a Python
//! `Protocol.data_plane_spec()` dict to a [`ProtocolSpec`], and back (for
//! `DataPlane.protocols`, so a test can check that the Python declarations
//! of the built-in protocols are the crate's built-in table).

use lowwater_dataplane::protocol::{ErrorFlavour, FieldKind, FieldRule, MessagesRule, Terminal};
use lowwater_dataplane::ProtocolSpec;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyTuple};

use crate::errors::DataPlaneConfigError;

/// `Protocol.data_plane_spec()`, item by item.
#[derive(FromPyObject)]
#[pyo3(from_item_all)]
pub(crate) struct WireSpec {
    name: String,
    path: String,
    flavour: String,
    messages: String,
    string_input: bool,
    roles: Vec<String>,
    fields: Vec<(String, String, bool)>,
    tools: Vec<String>,
    terminal_data: Option<String>,
    terminal_types: Vec<String>,
    reads_any_json: bool,
}

fn bad(name: &str, why: String) -> PyErr {
    DataPlaneConfigError::new_err(format!("protocol {name:?}: {why}"))
}

impl WireSpec {
    /// The crate's descriptor; `DataPlaneConfigError` for an unknown flavour
    /// or field kind, or not exactly one terminal rule.
    pub(crate) fn into_spec(self) -> PyResult<ProtocolSpec> {
        let Some(flavour) = flavour_named(&self.flavour) else {
            return Err(bad(&self.name, format!("unknown error flavour {:?}", self.flavour)));
        };
        let terminal = match (self.terminal_data, self.terminal_types.is_empty()) {
            (Some(data), true) => Terminal::Data(data),
            (None, false) => Terminal::Types(self.terminal_types),
            _ => return Err(bad(&self.name, "give exactly one of terminal_data and terminal_types".into())),
        };
        let fields = self
            .fields
            .into_iter()
            .map(|(name, kind, required)| {
                let kind = match kind.as_str() {
                    "string" => FieldKind::String,
                    "positive_integer" => FieldKind::PositiveInteger,
                    "string_or_array" => FieldKind::StringOrArray,
                    other => return Err(bad(&self.name, format!("field {name:?}: unknown kind {other:?}"))),
                };
                Ok(FieldRule { name, kind, required })
            })
            .collect::<PyResult<Vec<_>>>()?;
        Ok(ProtocolSpec {
            name: self.name,
            path: self.path,
            flavour,
            terminal,
            messages: MessagesRule { key: self.messages, allow_string: self.string_input, roles: self.roles },
            fields,
            tools: self.tools,
            reads_any_json: self.reads_any_json,
        })
    }
}

/// The error flavour a protocol names (`"openai"`, `"anthropic"`).
fn flavour_named(name: &str) -> Option<ErrorFlavour> {
    match name {
        "openai" => Some(ErrorFlavour::OpenAi),
        "anthropic" => Some(ErrorFlavour::Anthropic),
        _ => None,
    }
}

fn flavour_arg(name: &str) -> PyResult<ErrorFlavour> {
    flavour_named(name).ok_or_else(|| PyValueError::new_err(format!("unknown error flavour {name:?}")))
}

/// `error_body(flavour, status, reason)`: the data plane's JSON error body,
/// so Python's answers (`Protocol.error_body`) are the plane's by
/// construction: the two kept their own status-to-type tables, and nothing
/// checked that they agreed.
#[pyfunction]
pub(crate) fn error_body<'py>(
    py: Python<'py>,
    flavour: &str,
    status: u16,
    reason: &str,
) -> PyResult<Bound<'py, PyBytes>> {
    Ok(PyBytes::new(py, &lowwater_dataplane::protocol::error_body(flavour_arg(flavour)?, status, reason)))
}

/// `error_event(flavour, reason)`: the data plane's SSE error event.
#[pyfunction]
pub(crate) fn error_event<'py>(py: Python<'py>, flavour: &str, reason: &str) -> PyResult<Bound<'py, PyBytes>> {
    Ok(PyBytes::new(py, &lowwater_dataplane::protocol::error_event(flavour_arg(flavour)?, reason)))
}

/// A descriptor as the dict `Protocol.data_plane_spec()` gives (tuples for
/// its sequences).
pub(crate) fn spec_dict<'py>(py: Python<'py>, spec: &ProtocolSpec) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("name", &spec.name)?;
    d.set_item("path", &spec.path)?;
    d.set_item(
        "flavour",
        match spec.flavour {
            ErrorFlavour::OpenAi => "openai",
            ErrorFlavour::Anthropic => "anthropic",
        },
    )?;
    d.set_item("messages", &spec.messages.key)?;
    d.set_item("string_input", spec.messages.allow_string)?;
    d.set_item("roles", PyTuple::new(py, &spec.messages.roles)?)?;
    let fields = spec.fields.iter().map(|f| {
        let kind = match f.kind {
            FieldKind::String => "string",
            FieldKind::PositiveInteger => "positive_integer",
            FieldKind::StringOrArray => "string_or_array",
        };
        (f.name.as_str(), kind, f.required)
    });
    d.set_item("fields", PyTuple::new(py, fields)?)?;
    d.set_item("tools", PyTuple::new(py, &spec.tools)?)?;
    d.set_item("reads_any_json", spec.reads_any_json)?;
    match &spec.terminal {
        Terminal::Data(data) => {
            d.set_item("terminal_data", data)?;
            d.set_item("terminal_types", PyTuple::empty(py))?;
        }
        Terminal::Types(types) => {
            d.set_item("terminal_data", py.None())?;
            d.set_item("terminal_types", PyTuple::new(py, types)?)?;
        }
    }
    Ok(d)
}

//! The `--plot` figure, one row per scenario:
//! * left, the vLLM paper's Fig. 2 form: a stacked bar per policy splitting the KV
//!   memory into token states, reserved for future tokens, internal fragmentation, and
//!   external fragmentation + free ([`PolicyReport::figure_split`]: shares of the whole
//!   pool for contiguous policies, of the memory held for paged ones), each segment
//!   labelled with its share and the paper's token-state share marked on the bar;
//! * right, the batch size (running requests) over time, per policy;
//! * with a KV-dtype comparison (`--kv-dtype fp8`), a third panel: each policy's mean
//!   batch with the cache at f16 (solid bar) and at fp8 (light bar, same colour), the
//!   values written on top; the figure widens by [`CMP_W`] for it.
//!
//! One legend band on top serves every row.
//!
//! With `--sweep`, [`render_sweep_svg`] draws the paper's Fig. 12 form instead.

use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use crate::sim::{KvDtypeComparison, MemorySplit, PolicyReport, ScenarioReport};

mod sweep;
pub use sweep::render_sweep_svg;

/// Policy colours, in [`crate::sim::Policy::ALL`] order.
const COLORS: [RGBColor; 6] = [
    RGBColor(214, 39, 40),
    RGBColor(255, 127, 14),
    RGBColor(148, 103, 189),
    RGBColor(31, 119, 180),
    RGBColor(44, 160, 44),
    RGBColor(23, 190, 207),
];

/// The bar segments, bottom to top: legend entry, fill, colour of the share printed on it.
const SEGMENTS: [(&str, RGBColor, RGBColor); 4] = [
    ("token states", RGBColor(46, 125, 50), WHITE),
    ("reserved for future tokens", RGBColor(255, 193, 94), BLACK),
    ("internal fragmentation", RGBColor(198, 40, 40), WHITE),
    (
        "external fragmentation + free",
        RGBColor(200, 200, 200),
        BLACK,
    ),
];

/// The legend entry of the paper's mark.
const PAPER_MARK: &str = "paper's token-state share (Fig. 2)";

const WIDTH: u32 = 1500;
const LEGEND_H: u32 = 84;
const ROW_H: u32 = 470;
/// Width of the bar panel; the batch panel takes the rest.
const BAR_W: u32 = 800;
/// Width added for the KV-dtype comparison panel, when a report has one.
pub const CMP_W: u32 = 560;
/// Segments thinner than this share (in %) carry no label.
const MIN_LABELLED: f64 = 4.0;
/// A label this close (in %) to the paper's mark would be crossed by it.
const MARK_CLEARANCE: f64 = 2.5;

fn font(size: u32) -> TextStyle<'static> {
    ("sans-serif", size).into_font().color(&BLACK)
}

fn shares(s: &MemorySplit) -> [f64; 4] {
    [
        s.token_states,
        s.reserved_future,
        s.internal_fragmentation,
        s.external_and_free,
    ]
}

/// Where to print the share of a segment spanning `[y, y + h]` (in %): its middle, or,
/// when the paper's mark crosses the middle, the middle of the larger part the mark
/// leaves; `None` when the segment, or that part, is too thin for a label.
fn label_height(y: f64, h: f64, mark: Option<f64>) -> Option<f64> {
    let mid = y + h / 2.0;
    match mark {
        Some(m) if (mid - m).abs() < MARK_CLEARANCE => {
            let (below, above) = (m - y, y + h - m);
            let (part, at) = if below >= above {
                (below, y + below / 2.0)
            } else {
                (above, m + above / 2.0)
            };
            (part >= MIN_LABELLED + MARK_CLEARANCE).then_some(at)
        }
        _ => (h >= MIN_LABELLED).then_some(mid),
    }
}

/// Renders the figure (see the module docs) as an SVG document.
pub fn render_svg(reports: &[ScenarioReport]) -> Result<String, Box<dyn std::error::Error>> {
    // A NaN or infinite axis bound would make plotters loop forever.
    for rep in reports {
        rep.check_finite()?;
    }
    let names: Vec<&str> = reports
        .first()
        .map(|r| {
            r.policies
                .iter()
                .map(|p| p.result.policy.as_str())
                .collect()
        })
        .unwrap_or_default();
    let mut svg = String::new();
    {
        let rows = reports.len().max(1) as u32;
        let compare = reports.iter().any(|r| r.kv_dtype_comparison.is_some());
        let width = WIDTH + if compare { CMP_W } else { 0 };
        let root =
            SVGBackend::with_string(&mut svg, (width, LEGEND_H + ROW_H * rows)).into_drawing_area();
        root.fill(&WHITE)?;
        let (band, body) = root.split_vertically(LEGEND_H);
        legend(&band, &names)?;
        for (rep, row) in reports.iter().zip(body.split_evenly((rows as usize, 1))) {
            let (left, rest) = row.split_horizontally(BAR_W);
            let (right, cmp) = rest.split_horizontally(WIDTH - BAR_W);
            let title = rep.workload.split(" (").next().unwrap_or("").to_string();
            bars(&root, &left, &title, &rep.policies)?;
            batch(&right, &title, &rep.policies)?;
            if let Some(c) = &rep.kv_dtype_comparison {
                dtype_batches(&root, &cmp, &title, c)?;
            }
        }
        root.present()?;
    }
    Ok(svg)
}

/// The legend band: bar segments and the paper's mark on the left, policies on the
/// right, and what the bars are shares of.
fn legend(
    band: &DrawingArea<SVGBackend, Shift>,
    policies: &[&str],
) -> Result<(), Box<dyn std::error::Error>> {
    // Crude text width (13 px sans-serif); the SVG viewer lays out the real text.
    let width = |s: &str| 7 * s.len() as i32;
    let mut x = 60;
    for (name, fill, _) in SEGMENTS {
        band.draw(&Rectangle::new([(x, 9), (x + 14, 23)], fill.filled()))?;
        band.draw(&Text::new(
            name,
            (x + 20, 16),
            font(13).pos(Pos::new(HPos::Left, VPos::Center)),
        ))?;
        x += 20 + width(name) + 20;
    }
    band.draw(&PathElement::new(
        vec![(60, 40), (74, 40)],
        BLACK.stroke_width(3),
    ))?;
    band.draw(&Text::new(
        PAPER_MARK,
        (80, 40),
        font(13).pos(Pos::new(HPos::Left, VPos::Center)),
    ))?;
    // Policies, three to a line.
    for (i, name) in policies.iter().enumerate() {
        let c = COLORS[i % COLORS.len()];
        let (x, y) = (
            BAR_W as i32 + 60 + 190 * (i as i32 % 3),
            16 + 24 * (i as i32 / 3),
        );
        band.draw(&PathElement::new(
            vec![(x, y), (x + 18, y)],
            c.stroke_width(2),
        ))?;
        band.draw(&Text::new(
            *name,
            (x + 24, y),
            font(13).pos(Pos::new(HPos::Left, VPos::Center)),
        ))?;
    }
    band.draw(&Text::new(
        "Bars: shares of KV memory, time-weighted: contiguous policies of the whole KV pool (the paper's Orca bars), \
         paged policies of the memory their blocks hold (the paper's vLLM bar).",
        (60, 66),
        font(12).pos(Pos::new(HPos::Left, VPos::Center)),
    ))?;
    Ok(())
}

/// One stacked bar per policy; `root` is the whole figure, for the labels under the
/// bars (drawn in figure pixels).
fn bars(
    root: &DrawingArea<SVGBackend, Shift>,
    cell: &DrawingArea<SVGBackend, Shift>,
    title: &str,
    policies: &[PolicyReport],
) -> Result<(), Box<dyn std::error::Error>> {
    let n = policies.len().max(1) as f64;
    let mut chart = ChartBuilder::on(cell)
        .caption(
            format!("{title}: where the KV memory goes (the paper's Fig. 2 form)"),
            ("sans-serif", 17),
        )
        .margin(12)
        .x_label_area_size(58)
        .y_label_area_size(58)
        .build_cartesian_2d(0.0..n, 0.0..100.0)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .light_line_style(TRANSPARENT)
        .x_labels(0)
        .y_labels(11)
        .y_label_formatter(&|v| format!("{v:.0}%"))
        .y_desc("share of KV memory")
        .draw()?;
    for (i, p) in policies.iter().enumerate() {
        let c = i as f64 + 0.5;
        let mut y = 0.0;
        for (v, (_, fill, ink)) in shares(&p.figure_split()).into_iter().zip(SEGMENTS) {
            let h = 100.0 * v;
            if h > 0.0 {
                chart.draw_series(std::iter::once(Rectangle::new(
                    [(c - 0.32, y), (c + 0.32, y + h)],
                    fill.filled(),
                )))?;
            }
            if let Some(at) = label_height(y, h, p.paper_token_share.map(|s| 100.0 * s)) {
                chart.draw_series(std::iter::once(Text::new(
                    format!("{h:.1}%"),
                    (c, at),
                    font(12)
                        .color(&ink)
                        .pos(Pos::new(HPos::Center, VPos::Center)),
                )))?;
            }
            y += h;
        }
        if let Some(paper) = p.paper_token_share {
            chart.draw_series(std::iter::once(PathElement::new(
                vec![(c - 0.42, 100.0 * paper), (c + 0.42, 100.0 * paper)],
                BLACK.stroke_width(3),
            )))?;
        }
        // Under the bar: the policy's name on two lines, then the paper's share.
        let (px, py) = chart.backend_coord(&(c, 0.0));
        let name = &p.result.policy;
        let (first, rest) = name.split_once(' ').unwrap_or((name, ""));
        let paper = p
            .paper_token_share
            .map(|s| format!("paper {:.1}%", 100.0 * s));
        for (k, line) in [Some(first.to_string()), Some(rest.to_string()), paper]
            .into_iter()
            .flatten()
            .enumerate()
        {
            root.draw(&Text::new(
                line,
                (px, py + 8 + 16 * k as i32),
                font(13).pos(Pos::new(HPos::Center, VPos::Top)),
            ))?;
        }
    }
    Ok(())
}

/// Decimals that tell apart the ticks of an axis from 0 to `max` (about ten ticks):
/// none from 10 up, one from 1, two from 0.1, and so on.
fn tick_digits(max: f64) -> usize {
    (1.0 - max.log10().floor()).clamp(0.0, 9.0) as usize
}

/// Running requests over simulated time, a line per policy.
fn batch(
    cell: &DrawingArea<SVGBackend, Shift>,
    title: &str,
    policies: &[PolicyReport],
) -> Result<(), Box<dyn std::error::Error>> {
    let t_max = policies
        .iter()
        .flat_map(|p| p.result.timeline.last().map(|x| x.0))
        .fold(1e-9, f64::max);
    let b_max = policies
        .iter()
        .flat_map(|p| p.result.timeline.iter().map(|x| x.2))
        .max()
        .unwrap_or(1)
        .max(1) as f64;
    let mut chart = ChartBuilder::on(cell)
        .caption(format!("{title}: batch size over time"), ("sans-serif", 17))
        .margin(12)
        .x_label_area_size(44)
        .y_label_area_size(58)
        .build_cartesian_2d(0.0..t_max, 0.0..b_max * 1.05)?;
    chart
        .configure_mesh()
        .x_desc("simulated time (s)")
        .y_desc("running requests")
        .x_label_formatter(&|v| format!("{v:.0$}", tick_digits(t_max)))
        .y_label_formatter(&|v| format!("{v:.0$}", tick_digits(b_max)))
        .draw()?;
    for (i, p) in policies.iter().enumerate() {
        let c = COLORS[i % COLORS.len()];
        let tl = &p.result.timeline;
        chart.draw_series(LineSeries::new(tl.iter().map(|x| (x.0, x.2 as f64)), c))?;
    }
    Ok(())
}

/// Each policy's mean batch with the cache at the baseline dtype (solid bar) and the
/// compared one (light bar, same colour), values on top, names under the pairs; `root`
/// is the whole figure, for the names (drawn in figure pixels).
fn dtype_batches(
    root: &DrawingArea<SVGBackend, Shift>,
    cell: &DrawingArea<SVGBackend, Shift>,
    title: &str,
    c: &KvDtypeComparison,
) -> Result<(), Box<dyn std::error::Error>> {
    let n = c.rows.len().max(1) as f64;
    let b_max = c
        .rows
        .iter()
        .map(|r| r.baseline_mean_batch.max(r.mean_batch))
        .fold(1.0, f64::max);
    let mut chart = ChartBuilder::on(cell)
        .caption(
            format!(
                "{title}: mean batch, KV cache {} (solid) vs {} (light)",
                c.baseline_dtype, c.kv_dtype
            ),
            ("sans-serif", 17),
        )
        .margin(12)
        .x_label_area_size(58)
        .y_label_area_size(50)
        .build_cartesian_2d(0.0..n, 0.0..b_max * 1.12)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(0)
        .y_label_formatter(&|v| format!("{v:.0$}", tick_digits(b_max)))
        .y_desc("mean running requests")
        .draw()?;
    for (i, r) in c.rows.iter().enumerate() {
        let col = COLORS[i % COLORS.len()];
        let x = i as f64;
        for (lo, v, style) in [
            (x + 0.12, r.baseline_mean_batch, col.filled()),
            (x + 0.5, r.mean_batch, col.mix(0.35).filled()),
        ] {
            chart.draw_series(std::iter::once(Rectangle::new(
                [(lo, 0.0), (lo + 0.38, v)],
                style,
            )))?;
            chart.draw_series(std::iter::once(Rectangle::new(
                [(lo, 0.0), (lo + 0.38, v)],
                col.stroke_width(1),
            )))?;
            chart.draw_series(std::iter::once(Text::new(
                format!("{v:.0$}", if v < 10.0 { 1 } else { 0 }),
                (lo + 0.19, v),
                font(11).pos(Pos::new(HPos::Center, VPos::Bottom)),
            )))?;
        }
        let (px, py) = chart.backend_coord(&(x + 0.5, 0.0));
        let name = &r.policy;
        let (first, rest) = name.split_once(' ').unwrap_or((name, ""));
        for (k, line) in [first, rest].into_iter().enumerate() {
            root.draw(&Text::new(
                line.to_string(),
                (px, py + 8 + 16 * k as i32),
                font(12).pos(Pos::new(HPos::Center, VPos::Top)),
            ))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::sim::{GpuSpec, ModelSpec, Policy, SimConfig, Workload, WorkloadKind, run_scenario};

    fn sharegpt() -> ScenarioReport {
        let cfg = SimConfig::new(
            GpuSpec::preset("a100-40gb").unwrap(),
            ModelSpec::preset("opt-13b").unwrap(),
        );
        let w = Workload::synthetic(WorkloadKind::ShareGpt, 2.0, 300, 2048, 1).unwrap();
        let kind = Some((WorkloadKind::ShareGpt, 2.0));
        run_scenario(&w, kind, &cfg, &Policy::ALL, &mut || {}).unwrap()
    }

    /// `name="…"` of an SVG element's line.
    fn attr<'a>(line: &'a str, name: &str) -> &'a str {
        let at = line.find(&format!(" {name}=\"")).unwrap() + name.len() + 3;
        &line[at..at + line[at..].find('"').unwrap()]
    }

    #[test]
    fn every_bar_spans_the_whole_axis_and_every_legend_entry_is_drawn() {
        let rep = sharegpt();
        let svg = render_svg(std::slice::from_ref(&rep)).unwrap();
        let fills: Vec<String> = SEGMENTS
            .iter()
            .map(|(_, c, _)| format!("#{:02X}{:02X}{:02X}", c.0, c.1, c.2))
            .collect();
        // Segment rectangles below the legend band, summed per bar (by their x).
        let mut bars: BTreeMap<i64, i64> = BTreeMap::new();
        for line in svg.lines().filter(|l| l.starts_with("<rect")) {
            let y: i64 = attr(line, "y").parse().unwrap();
            if y < LEGEND_H as i64 || !fills.iter().any(|f| f == attr(line, "fill")) {
                continue;
            }
            let x: i64 = attr(line, "x").parse().unwrap();
            *bars.entry(x).or_default() += attr(line, "height").parse::<i64>().unwrap();
        }
        assert_eq!(bars.len(), Policy::ALL.len(), "{bars:?}");
        let (lo, hi) = (bars.values().min().unwrap(), bars.values().max().unwrap());
        assert!(
            *lo > 250 && hi - lo <= 3,
            "bars of unequal heights: {bars:?}"
        );
        for p in &rep.policies {
            let s = p.figure_split();
            let total =
                s.token_states + s.reserved_future + s.internal_fragmentation + s.external_and_free;
            assert!((total - 1.0).abs() < 1e-9, "{}: {total}", p.result.policy);
        }
        for want in SEGMENTS
            .iter()
            .map(|s| s.0)
            .chain(["token-state share (Fig. 2)", "paper 20.4%", "paper 96.3%"])
            .chain(["batch size over time", "running requests"])
        {
            assert!(svg.contains(want), "no `{want}` in the SVG");
        }
        for p in Policy::ALL {
            assert!(svg.contains(&p.name()), "no `{}` in the SVG", p.name());
        }
        assert!(!svg.contains("KV memory held"));
    }

    #[test]
    fn axis_ticks_get_the_decimals_they_need() {
        assert_eq!(tick_digits(2700.0), 0);
        assert_eq!(tick_digits(17.5), 0);
        assert_eq!(tick_digits(5.0), 1);
        assert_eq!(tick_digits(1.05), 1);
        assert_eq!(tick_digits(0.05), 3);
        assert_eq!(tick_digits(1e-9), 9);
    }

    #[test]
    fn a_label_the_papers_mark_would_cross_moves_or_goes() {
        // Far from the mark: the middle.
        assert_eq!(label_height(0.0, 40.0, Some(90.0)), Some(20.0));
        // Crossed: the middle of the larger part the mark leaves.
        assert_eq!(label_height(0.0, 40.0, Some(21.0)), Some(10.5));
        assert_eq!(label_height(80.0, 20.0, Some(89.0)), Some(94.5));
        // Crossed and both parts too thin, or too thin anyway: no label.
        assert_eq!(label_height(92.8, 7.2, Some(96.3)), None);
        assert_eq!(label_height(0.0, 3.5, None), None);
    }
}

//! The `--sweep --plot` figure, the vLLM paper's Fig. 12 form: per workload a panel of
//! mean normalised latency (s/token) against request rate (req/s), a line per policy
//! (the colours of the fixed-rate figure), the common latency bound dashed, and each
//! policy's highest sustained rate ringed. Latencies above the panel's top (four times
//! the bound: past the knee a queue grows without limit) are drawn on the top edge.

use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use super::{COLORS, font, tick_digits};
use crate::sim::{Policy, SweepReport};

const PANEL_W: u32 = 720;
const HEIGHT: u32 = 560;
const LEGEND_H: u32 = 40;

/// The colour of the policy named `name` (its place in [`Policy::ALL`]).
fn color_of(name: &str) -> RGBColor {
    let i = Policy::ALL
        .iter()
        .position(|p| p.name() == name)
        .unwrap_or(0);
    COLORS[i % COLORS.len()]
}

/// The figure for `reports` (one panel each), as an SVG document.
pub fn render_sweep_svg(reports: &[SweepReport]) -> Result<String, Box<dyn std::error::Error>> {
    // A NaN or infinite axis bound would make plotters loop forever.
    for r in reports {
        r.check_finite()?;
    }
    let mut svg = String::new();
    {
        let panels = reports.len().max(1) as u32;
        let root = SVGBackend::with_string(&mut svg, (PANEL_W * panels, LEGEND_H + HEIGHT))
            .into_drawing_area();
        root.fill(&WHITE)?;
        let (band, body) = root.split_vertically(LEGEND_H);
        // Legend: the policies of the first report, and the bound.
        let mut x = 60;
        if let Some(first) = reports.first() {
            for p in &first.policies {
                let c = color_of(&p.policy);
                band.draw(&PathElement::new(
                    vec![(x, 20), (x + 24, 20)],
                    c.stroke_width(3),
                ))?;
                band.draw(&Circle::new((x + 12, 20), 4, c.filled()))?;
                band.draw(&Text::new(
                    p.policy.clone(),
                    (x + 30, 20),
                    font(13).pos(Pos::new(HPos::Left, VPos::Center)),
                ))?;
                x += 30 + 7 * p.policy.len() as i32 + 24;
            }
        }
        band.draw(&Text::new(
            "dashed: latency bound; ringed: highest rate sustained",
            (x, 20),
            font(13).pos(Pos::new(HPos::Left, VPos::Center)),
        ))?;
        for (rep, cell) in reports.iter().zip(body.split_evenly((1, panels as usize))) {
            panel(&cell, rep)?;
        }
        root.present()?;
    }
    Ok(svg)
}

/// One workload's panel.
fn panel(
    cell: &DrawingArea<SVGBackend, plotters::coord::Shift>,
    rep: &SweepReport,
) -> Result<(), Box<dyn std::error::Error>> {
    let y_max = 4.0 * rep.latency_bound;
    // Up to a little past the last knee (every policy's first rate over the bound),
    // or every rate when none crossed it.
    let all_max = rep
        .policies
        .iter()
        .flat_map(|p| p.points.iter().map(|x| x.rate))
        .fold(1e-9, f64::max);
    let knees = rep
        .policies
        .iter()
        .map(|p| {
            p.points
                .iter()
                .find(|x| x.mean_normalized_latency > rep.latency_bound)
                .map(|x| x.rate)
        })
        .collect::<Option<Vec<f64>>>();
    // (The axis ends at the last rate drawn.)
    let x_max = match knees {
        Some(k) if !k.is_empty() => {
            let limit = k.iter().fold(0.0, |a: f64, &b| a.max(b)) * 1.3;
            rep.policies
                .iter()
                .flat_map(|p| p.points.iter().map(|x| x.rate))
                .filter(|&r| r <= limit)
                .fold(1e-9, f64::max)
        }
        _ => all_max,
    };
    let title = rep.workload.split(" (").next().unwrap_or("").to_string();
    let mut chart = ChartBuilder::on(cell)
        .caption(
            format!("{title}: {} on {}", rep.model, rep.gpu),
            ("sans-serif", 17),
        )
        .margin(14)
        .x_label_area_size(44)
        .y_label_area_size(62)
        .build_cartesian_2d(0.0..x_max * 1.02, 0.0..y_max * 1.04)?;
    chart
        .configure_mesh()
        .x_desc("request rate (req/s)")
        .y_desc("normalised latency (s/token)")
        .x_label_formatter(&|v| format!("{v:.0$}", tick_digits(x_max)))
        .y_label_formatter(&|v| format!("{v:.0$}", tick_digits(y_max) + 1))
        .draw()?;
    chart.draw_series(DashedLineSeries::new(
        [(0.0, rep.latency_bound), (x_max * 1.02, rep.latency_bound)],
        8,
        6,
        RGBColor(90, 90, 90).stroke_width(2),
    ))?;
    for p in &rep.policies {
        let c = color_of(&p.policy);
        let pts: Vec<(f64, f64)> = p
            .points
            .iter()
            .filter(|x| x.rate <= x_max)
            .map(|x| (x.rate, x.mean_normalized_latency.min(y_max)))
            .collect();
        chart.draw_series(LineSeries::new(pts.iter().copied(), c.stroke_width(2)))?;
        chart.draw_series(pts.iter().map(|&xy| Circle::new(xy, 3, c.filled())))?;
        if let Some(r) = p.max_rate
            && let Some(x) = p.points.iter().find(|x| x.rate == r)
        {
            chart.draw_series(std::iter::once(Circle::new(
                (r, x.mean_normalized_latency.min(y_max)),
                8,
                c.stroke_width(2),
            )))?;
        }
    }
    Ok(())
}

//! The `--plot` figure: KV memory held and batch size over time, per policy.

use plotters::prelude::*;

use crate::sim::ScenarioReport;

const COLORS: [RGBColor; 6] = [
    RGBColor(214, 39, 40),
    RGBColor(255, 127, 14),
    RGBColor(148, 103, 189),
    RGBColor(31, 119, 180),
    RGBColor(44, 160, 44),
    RGBColor(23, 190, 207),
];

/// Renders one row per scenario (KV memory held / pool on the left, running requests on
/// the right) as an SVG document.
pub fn render_svg(reports: &[ScenarioReport]) -> Result<String, Box<dyn std::error::Error>> {
    // A NaN or infinite axis bound would make plotters loop forever.
    for rep in reports {
        rep.check_finite()?;
    }
    let mut svg = String::new();
    {
        let rows = reports.len().max(1);
        let root = SVGBackend::with_string(&mut svg, (1200, 360 * rows as u32)).into_drawing_area();
        root.fill(&WHITE)?;
        let cells = root.split_evenly((rows, 2));
        for (r, rep) in reports.iter().enumerate() {
            let t_max = rep
                .policies
                .iter()
                .flat_map(|p| p.result.timeline.last().map(|x| x.0))
                .fold(1e-9, f64::max);
            let b_max = rep
                .policies
                .iter()
                .flat_map(|p| p.result.timeline.iter().map(|x| x.2))
                .max()
                .unwrap_or(1)
                .max(1) as f64;
            let title = rep.workload.split(" (").next().unwrap_or("").to_string();
            let mut mem = ChartBuilder::on(&cells[2 * r])
                .caption(
                    format!("{title}: KV memory held / pool"),
                    ("sans-serif", 16),
                )
                .margin(10)
                .x_label_area_size(30)
                .y_label_area_size(45)
                .build_cartesian_2d(0.0..t_max, 0.0..1.05)?;
            mem.configure_mesh().x_desc("simulated time (s)").draw()?;
            let mut batch = ChartBuilder::on(&cells[2 * r + 1])
                .caption(format!("{title}: running requests"), ("sans-serif", 16))
                .margin(10)
                .x_label_area_size(30)
                .y_label_area_size(45)
                .build_cartesian_2d(0.0..t_max, 0.0..b_max * 1.05)?;
            batch.configure_mesh().x_desc("simulated time (s)").draw()?;
            for (i, p) in rep.policies.iter().enumerate() {
                let c = COLORS[i % COLORS.len()];
                let tl = &p.result.timeline;
                mem.draw_series(LineSeries::new(tl.iter().map(|x| (x.0, x.1)), c))?
                    .label(p.result.policy.clone())
                    .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], c));
                batch.draw_series(LineSeries::new(tl.iter().map(|x| (x.0, x.2 as f64)), c))?;
            }
            mem.configure_series_labels()
                .position(SeriesLabelPosition::LowerRight)
                .background_style(WHITE.mix(0.8))
                .border_style(BLACK)
                .draw()?;
        }
        root.present()?;
    }
    Ok(svg)
}
